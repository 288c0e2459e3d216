//! The `[auth]` section: the API keys and the JWT issuer that make a principal, and what each principal may call.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::limits::{Rates, RawRate, validate_rate};
use super::{Problems, file};
use crate::protocol::NameSet;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    /// Whether the client's `Authorization` / `x-api-key` reach the backends (default: they do not).
    #[serde(default)]
    pub forward_credentials: bool,
    #[serde(default)]
    pub api_keys: Vec<RawApiKey>,
    pub jwt: Option<RawJwt>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawApiKey {
    /// The principal: named in logs and in the request counter's `principal` label.
    pub name: String,
    /// Hex SHA-256 of the key; the key itself is never in the configuration.
    pub sha256: String,
    /// Public model names it may use; `["*"]` for every model.
    #[serde(default)]
    pub models: Vec<String>,
    /// Repository load and unload.
    #[serde(default)]
    pub admin: bool,
    /// A token bucket for this principal's calls.
    pub rate: Option<RawRate>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJwt {
    /// JWK set of the issuer's public keys (RS256, ES256, EdDSA); re-read on reload.
    pub jwks_file: String,
    /// The `iss` a token must carry.
    pub issuer: String,
    /// The `aud` a token must carry.
    pub audience: String,
    /// The claim naming the principal (default `sub`).
    pub principal_claim: Option<String>,
    /// The claim listing the models a principal may use, or `"*"` (default `models`).
    pub models_claim: Option<String>,
    /// The claim that is `true` for an admin (default: no token is admin).
    pub admin_claim: Option<String>,
    /// A token bucket for each principal a token names (its own, not shared between principals).
    pub rate: Option<RawRate>,
}

/// Who may call the gateway, and what each principal may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Auth {
    pub forward_credentials: bool,
    pub api_keys: Vec<ApiKey>,
    pub jwt: Option<Jwt>,
}

/// A configured API key.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiKey {
    pub name: String,
    pub sha256: [u8; 32],
    pub models: ModelScope,
    pub admin: bool,
    pub rate: Rates,
}

/// The public models a principal may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelScope {
    Every,
    Only(NameSet),
}

impl ModelScope {
    pub fn allows(&self, model: &str) -> bool {
        match self {
            ModelScope::Every => true,
            ModelScope::Only(models) => models.contains(model),
        }
    }
}

/// Bearer JWTs from one identity provider.
#[derive(Debug, Clone, PartialEq)]
pub struct Jwt {
    pub jwks_file: PathBuf,
    pub issuer: String,
    pub audience: String,
    pub principal_claim: String,
    pub models_claim: String,
    pub admin_claim: Option<String>,
    /// Each token principal's own bucket and token budget.
    pub rate: Rates,
}

/// The `[auth]` section: keys named once each, with well-formed digests, scoped to configured models.
pub(super) fn validate_auth(problems: &mut Problems, auth: &RawAuth, models: &HashSet<&str>, base: &Path) -> Auth {
    let mut names = HashSet::new();
    let mut digests = HashSet::new();
    let mut api_keys = Vec::with_capacity(auth.api_keys.len());
    for (i, key) in auth.api_keys.iter().enumerate() {
        let path = format!("auth.api_keys[{i}]");
        if key.name.is_empty() || key.name.len() > 64 || !key.name.bytes().all(|c| c.is_ascii_graphic()) {
            problems.add(
                format!("{path}.name"),
                "must be 1 to 64 visible ASCII characters (it is a metrics label)",
            );
        } else if key.name == super::OTHER_LABEL {
            problems.add(
                format!("{path}.name"),
                "is the label of calls by no configured principal",
            );
        } else if !names.insert(key.name.as_str()) {
            problems.add(format!("{path}.name"), format!("\"{}\" names two keys", key.name));
        }
        let sha256 = digest(&key.sha256);
        match sha256 {
            None => problems.add(
                format!("{path}.sha256"),
                "is not 64 hexadecimal digits (the SHA-256 of the key, not the key)",
            ),
            Some(digest) if !digests.insert(digest) => {
                problems.add(format!("{path}.sha256"), "is the digest of another key");
            }
            Some(_) => {}
        }
        api_keys.push(ApiKey {
            name: key.name.clone(),
            sha256: sha256.unwrap_or_default(),
            models: scope(problems, &format!("{path}.models"), &key.models, models),
            admin: key.admin,
            rate: key
                .rate
                .as_ref()
                .map(|rate| validate_rate(problems, &format!("{path}.rate"), rate))
                .unwrap_or_default(),
        });
    }
    let jwt = auth.jwt.as_ref().map(|jwt| {
        for (key, value) in [("issuer", &jwt.issuer), ("audience", &jwt.audience)] {
            if value.is_empty() {
                problems.add(format!("auth.jwt.{key}"), "must not be empty");
            }
        }
        Jwt {
            jwks_file: file(problems, "auth.jwt.jwks_file", &jwt.jwks_file, base),
            issuer: jwt.issuer.clone(),
            audience: jwt.audience.clone(),
            principal_claim: jwt.principal_claim.clone().unwrap_or_else(|| "sub".into()),
            models_claim: jwt.models_claim.clone().unwrap_or_else(|| "models".into()),
            admin_claim: jwt.admin_claim.clone(),
            rate: jwt
                .rate
                .as_ref()
                .map(|rate| validate_rate(problems, "auth.jwt.rate", rate))
                .unwrap_or_default(),
        }
    });
    if api_keys.is_empty() && jwt.is_none() {
        problems.add(
            "auth",
            "names no API key and no JWT issuer: nobody could call the gateway",
        );
    }
    Auth {
        forward_credentials: auth.forward_credentials,
        api_keys,
        jwt,
    }
}

/// A hex SHA-256 digest, either case.
fn digest(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut digest = [0u8; 32];
    for (byte, pair) in digest.iter_mut().zip(hex.chunks_exact(2)) {
        let text = std::str::from_utf8(pair).ok()?;
        *byte = u8::from_str_radix(text, 16).ok()?;
    }
    Some(digest)
}

/// A key's models: `["*"]`, or configured model names.
fn scope(problems: &mut Problems, path: &str, listed: &[String], models: &HashSet<&str>) -> ModelScope {
    if listed.iter().any(|m| m == "*") {
        if listed.len() > 1 {
            problems.add(path, "\"*\" already names every model; list it alone");
        }
        return ModelScope::Every;
    }
    for (i, model) in listed.iter().enumerate() {
        if !models.contains(model.as_str()) {
            problems.add(format!("{path}[{i}]"), format!("no model named \"{model}\""));
        }
    }
    ModelScope::Only(listed.iter().cloned().collect())
}
