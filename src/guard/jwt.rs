//! Bearer JWTs: the issuer's key set read from its JWKS file, and each token verified against the one key it names,
//! with that key's algorithm only.

use std::path::Path;
use std::sync::Arc;

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;

use super::Principal;
use crate::config::{Jwt, ModelScope, Problem};

/// How far a token's `exp` and `nbf` may be off the gateway's clock.
const LEEWAY_SECONDS: u64 = 30;

/// One public key of the issuer, with the one algorithm tokens signed by it may use.
struct JwtKey {
    id: Option<String>,
    algorithm: Algorithm,
    key: DecodingKey,
}

/// The issuer's public keys.
pub struct JwtKeys {
    keys: Vec<JwtKey>,
}

impl std::fmt::Debug for JwtKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtKeys").field("keys", &self.keys.len()).finish()
    }
}

/// Whether a credential has a JWT's shape (three base64url parts), rather than an API key's.
pub(super) fn looks_like_jwt(credential: &str) -> bool {
    credential.split('.').count() == 3
        && credential
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

impl JwtKeys {
    /// Reads the JWK set at `path`; each key must be an RSA, P-256/P-384 or Ed25519 public key.
    pub fn load(path: &Path) -> Result<Arc<JwtKeys>, Problem> {
        let problem = |message: String| Problem {
            path: "auth.jwt.jwks_file".into(),
            message,
        };
        let text =
            std::fs::read_to_string(path).map_err(|e| problem(format!("cannot read {}: {e}", path.display())))?;
        let set: JwkSet =
            serde_json::from_str(&text).map_err(|e| problem(format!("{} is not a JWK set: {e}", path.display())))?;
        let mut keys = Vec::with_capacity(set.keys.len());
        for (index, jwk) in set.keys.iter().enumerate() {
            let algorithm = algorithm(jwk).ok_or_else(|| {
                problem(format!(
                    "key {index} of {} is not an RS256/384/512, PS256/384/512, ES256/384 or EdDSA public key",
                    path.display()
                ))
            })?;
            let key = DecodingKey::from_jwk(jwk)
                .map_err(|e| problem(format!("key {index} of {} cannot be used: {e}", path.display())))?;
            keys.push(JwtKey {
                id: jwk.common.key_id.clone(),
                algorithm,
                key,
            });
        }
        if keys.is_empty() {
            return Err(problem(format!("{} has no keys", path.display())));
        }
        Ok(Arc::new(JwtKeys { keys }))
    }

    /// The principal a valid token names. The token's key is the one its `kid` names (or the only one); its
    /// algorithm must be that key's, which rules out `none` and an HMAC signed with a public key.
    pub(super) fn verify(&self, token: &str, settings: &Jwt) -> Result<Arc<Principal>, String> {
        let header = jsonwebtoken::decode_header(token).map_err(|e| e.to_string())?;
        let key = match &header.kid {
            Some(id) => self.keys.iter().find(|key| key.id.as_deref() == Some(id.as_str())),
            None if self.keys.len() == 1 => self.keys.first(),
            None => None,
        }
        .ok_or("it names no key of the issuer (kid)")?;
        if header.alg != key.algorithm {
            return Err(format!(
                "it is signed with {:?}, and its key is for {:?} only",
                header.alg, key.algorithm
            ));
        }
        let mut validation = Validation::new(key.algorithm);
        validation.leeway = LEEWAY_SECONDS;
        validation.validate_nbf = true;
        validation.set_issuer(&[&settings.issuer]);
        validation.set_audience(&[&settings.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        let claims = jsonwebtoken::decode::<serde_json::Map<String, Value>>(token, &key.key, &validation)
            .map_err(|e| e.to_string())?
            .claims;
        let name = match claims.get(&settings.principal_claim) {
            Some(Value::String(name)) if !name.is_empty() => name.clone(),
            _ => return Err(format!("its `{}` claim names no principal", settings.principal_claim)),
        };
        let models = match claims.get(&settings.models_claim) {
            Some(Value::String(all)) if all == "*" => ModelScope::Every,
            Some(Value::Array(names)) => ModelScope::Only(
                names
                    .iter()
                    .filter_map(|name| name.as_str().map(str::to_owned))
                    .collect(),
            ),
            _ => ModelScope::Only(Default::default()),
        };
        let admin = settings
            .admin_claim
            .as_ref()
            .is_some_and(|claim| claims.get(claim) == Some(&Value::Bool(true)));
        Ok(Arc::new(Principal {
            name,
            counted: None,
            models: Arc::new(models),
            admin,
            bucket: None,
            tokens: None,
        }))
    }
}

/// The algorithm a key is for: the one it states, else the one its type and curve imply.
fn algorithm(jwk: &Jwk) -> Option<Algorithm> {
    let stated = jwk.common.key_algorithm.and_then(|stated| match stated {
        KeyAlgorithm::RS256 => Some(Algorithm::RS256),
        KeyAlgorithm::RS384 => Some(Algorithm::RS384),
        KeyAlgorithm::RS512 => Some(Algorithm::RS512),
        KeyAlgorithm::PS256 => Some(Algorithm::PS256),
        KeyAlgorithm::PS384 => Some(Algorithm::PS384),
        KeyAlgorithm::PS512 => Some(Algorithm::PS512),
        KeyAlgorithm::ES256 => Some(Algorithm::ES256),
        KeyAlgorithm::ES384 => Some(Algorithm::ES384),
        KeyAlgorithm::EdDSA => Some(Algorithm::EdDSA),
        // HMAC secrets and encryption keys have no place in a set of public keys.
        _ => None,
    });
    let implied = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Some(Algorithm::RS256),
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => Some(Algorithm::ES256),
            EllipticCurve::P384 => Some(Algorithm::ES384),
            _ => None,
        },
        AlgorithmParameters::OctetKeyPair(okp) if okp.curve == EllipticCurve::Ed25519 => Some(Algorithm::EdDSA),
        _ => None,
    };
    let family_fits = |algorithm: Algorithm| match (&jwk.algorithm, algorithm) {
        (AlgorithmParameters::RSA(_), a) => matches!(
            a,
            Algorithm::RS256
                | Algorithm::RS384
                | Algorithm::RS512
                | Algorithm::PS256
                | Algorithm::PS384
                | Algorithm::PS512
        ),
        (AlgorithmParameters::EllipticCurve(_), a) => Some(a) == implied,
        (AlgorithmParameters::OctetKeyPair(_), Algorithm::EdDSA) => implied.is_some(),
        _ => false,
    };
    match (jwk.common.key_algorithm, stated) {
        (None, _) => implied,
        (Some(_), Some(stated)) if family_fits(stated) => Some(stated),
        _ => None,
    }
}
