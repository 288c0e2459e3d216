//! TLS material: certificates and keys read from PEM files and checked (readable, matching, not expired), the front
//! doors' certificate and client-CA held swappable so a reload takes effect on the next handshake, and the client
//! configurations for backends.

use std::path::Path;
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, NoClientAuth, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, UnixTime};

use crate::config::{BackendTls, Problem, ServerTls};

/// ALPN for a door that speaks HTTP/2 and HTTP/1.1.
pub const ALPN_H2_HTTP1: [&[u8]; 2] = [b"h2", b"http/1.1"];

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn problem(path: &str, message: String) -> Problem {
    Problem {
        path: path.to_owned(),
        message,
    }
}

/// Reads a PEM certificate chain (leaf first), refusing an empty, unparsable, expired or not yet valid leaf.
pub fn read_chain(path: &Path, key: &str) -> Result<Vec<CertificateDer<'static>>, Problem> {
    let text = std::fs::read(path).map_err(|e| problem(key, format!("cannot read {}: {e}", path.display())))?;
    let chain = CertificateDer::pem_slice_iter(&text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| problem(key, format!("{} is not a PEM certificate chain: {e}", path.display())))?;
    let Some(leaf) = chain.first() else {
        return Err(problem(key, format!("{} holds no certificate", path.display())));
    };
    check_validity(leaf, path, key)?;
    Ok(chain)
}

fn check_validity(certificate: &CertificateDer<'_>, path: &Path, key: &str) -> Result<(), Problem> {
    let (_, parsed) = x509_parser::parse_x509_certificate(certificate).map_err(|e| {
        problem(
            key,
            format!("{}: the certificate cannot be parsed: {e}", path.display()),
        )
    })?;
    let validity = parsed.validity();
    let now = x509_parser::time::ASN1Time::now();
    if now > validity.not_after {
        return Err(problem(
            key,
            format!("{}: the certificate expired on {}", path.display(), validity.not_after),
        ));
    }
    if now < validity.not_before {
        return Err(problem(
            key,
            format!(
                "{}: the certificate is not valid before {}",
                path.display(),
                validity.not_before
            ),
        ));
    }
    Ok(())
}

/// Reads a PEM private key (PKCS#8, PKCS#1 or SEC1).
pub fn read_key(path: &Path, key: &str) -> Result<PrivateKeyDer<'static>, Problem> {
    let text = std::fs::read(path).map_err(|e| problem(key, format!("cannot read {}: {e}", path.display())))?;
    PrivateKeyDer::from_pem_slice(&text)
        .map_err(|e| problem(key, format!("{} holds no usable PEM private key: {e}", path.display())))
}

/// Reads a PEM CA bundle into a root store.
pub fn read_roots(path: &Path, key: &str) -> Result<RootCertStore, Problem> {
    let text = std::fs::read(path).map_err(|e| problem(key, format!("cannot read {}: {e}", path.display())))?;
    let mut roots = RootCertStore::empty();
    for certificate in CertificateDer::pem_slice_iter(&text) {
        let certificate =
            certificate.map_err(|e| problem(key, format!("{} is not a PEM CA bundle: {e}", path.display())))?;
        roots
            .add(certificate)
            .map_err(|e| problem(key, format!("{}: a CA certificate is unusable: {e}", path.display())))?;
    }
    if roots.is_empty() {
        return Err(problem(key, format!("{} holds no CA certificate", path.display())));
    }
    Ok(roots)
}

/// A certificate chain with its key, checked to belong together.
fn certified_key(cert: &Path, key: &Path, prefix: &str) -> Result<CertifiedKey, Problem> {
    let chain = read_chain(cert, &format!("{prefix}cert"))?;
    let private = read_key(key, &format!("{prefix}key"))?;
    let certified = CertifiedKey::from_der(chain, private, &provider()).map_err(|e| {
        problem(
            &format!("{prefix}key"),
            format!("{} does not fit {}: {e}", key.display(), cert.display()),
        )
    })?;
    Ok(certified)
}

/// The front doors' TLS material as loaded from the files the configuration names.
#[derive(Debug)]
pub struct ServerMaterial {
    key: Arc<CertifiedKey>,
    verifier: Arc<dyn ClientCertVerifier>,
}

impl ServerMaterial {
    /// Reads and checks every file; each problem names its configuration key.
    pub fn load(tls: &ServerTls) -> Result<ServerMaterial, Problem> {
        let key = Arc::new(certified_key(&tls.cert, &tls.key, "tls.")?);
        let verifier: Arc<dyn ClientCertVerifier> = match &tls.client_ca {
            None => Arc::new(NoClientAuth),
            Some(ca) => {
                let roots = read_roots(ca, "tls.client_ca")?;
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                    .build()
                    .map_err(|e| problem("tls.client_ca", format!("{}: {e}", ca.display())))?
            }
        };
        Ok(ServerMaterial { key, verifier })
    }
}

/// The front doors' certificate and client verification, swapped whole on reload; every handshake reads the current
/// one, so a renewed certificate needs no restart.
#[derive(Debug)]
pub struct ServerIdentity {
    current: ArcSwap<ServerMaterial>,
}

impl ServerIdentity {
    pub fn new(material: ServerMaterial) -> Arc<ServerIdentity> {
        Arc::new(ServerIdentity {
            current: ArcSwap::from_pointee(material),
        })
    }

    pub fn replace(&self, material: ServerMaterial) {
        self.current.store(Arc::new(material));
    }

    /// A rustls server configuration that reads this identity at each handshake, offering `alpn`.
    pub fn server_config(self: &Arc<Self>, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_or_else(
                |_| rustls::ServerConfig::builder().with_client_cert_verifier(self.verifier()),
                |builder| builder.with_client_cert_verifier(self.verifier()),
            )
            .with_cert_resolver(self.resolver());
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }

    pub fn resolver(self: &Arc<Self>) -> Arc<dyn ResolvesServerCert> {
        Arc::new(CurrentCertificate(self.clone()))
    }

    pub fn verifier(self: &Arc<Self>) -> Arc<dyn ClientCertVerifier> {
        Arc::new(CurrentVerifier(self.clone()))
    }
}

#[derive(Debug)]
struct CurrentCertificate(Arc<ServerIdentity>);

impl ResolvesServerCert for CurrentCertificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current.load().key.clone())
    }
}

/// Client-certificate verification by whichever CA bundle is current.
#[derive(Debug)]
struct CurrentVerifier(Arc<ServerIdentity>);

impl CurrentVerifier {
    fn now(&self) -> Arc<dyn ClientCertVerifier> {
        self.0.current.load().verifier.clone()
    }
}

impl ClientCertVerifier for CurrentVerifier {
    fn offer_client_auth(&self) -> bool {
        self.now().offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.now().client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // The hints are optional; answering none keeps this free of borrowing from a swappable value.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.now().verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.now().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.now().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.now().supported_verify_schemes()
    }
}

/// A backend's TLS material as loaded: what its clients verify against and present.
#[derive(Debug, Clone)]
pub struct BackendMaterial {
    /// The configured CA bundle, or none for the system's roots.
    pub ca: Option<Vec<CertificateDer<'static>>>,
    /// The client certificate chain and key (DER), for mTLS.
    pub client_cert: Option<(Vec<CertificateDer<'static>>, Vec<u8>)>,
    pub server_name: Option<String>,
    /// The files' bytes, to tell a changed certificate from an unchanged one on reload.
    fingerprint: Vec<u8>,
    config: Arc<rustls::ClientConfig>,
}

impl PartialEq for BackendMaterial {
    fn eq(&self, other: &Self) -> bool {
        self.fingerprint == other.fingerprint && self.server_name == other.server_name
    }
}

impl BackendMaterial {
    /// Reads and checks the files of `backends[index].tls`.
    pub fn load(tls: &BackendTls, index: usize) -> Result<BackendMaterial, Problem> {
        let prefix = format!("backends[{index}].tls.");
        let mut fingerprint = Vec::new();
        let (roots, ca) = match &tls.ca {
            Some(path) => {
                let roots = read_roots(path, &format!("{prefix}ca"))?;
                let text = std::fs::read(path).unwrap_or_default();
                let ca = CertificateDer::pem_slice_iter(&text)
                    .filter_map(Result::ok)
                    .collect::<Vec<_>>();
                fingerprint.extend_from_slice(&text);
                (roots, Some(ca))
            }
            None => {
                let mut roots = RootCertStore::empty();
                for certificate in rustls_native_certs::load_native_certs().unwrap_or_default() {
                    let _ = roots.add(certificate);
                }
                (roots, None)
            }
        };
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| problem(&format!("{prefix}ca"), e.to_string()))?
            .with_root_certificates(roots);
        let (config, client_cert) = match &tls.client_cert {
            None => (builder.with_no_client_auth(), None),
            Some((cert, key)) => {
                let chain = read_chain(cert, &format!("{prefix}cert"))?;
                let private = read_key(key, &format!("{prefix}key"))?;
                let key_der = private.secret_der().to_vec();
                fingerprint.extend(chain.iter().flat_map(|c| c.as_ref().iter().copied()));
                fingerprint.extend_from_slice(&key_der);
                let config = builder.with_client_auth_cert(chain.clone(), private).map_err(|e| {
                    problem(
                        &format!("{prefix}key"),
                        format!("{} does not fit {}: {e}", key.display(), cert.display()),
                    )
                })?;
                (config, Some((chain, key_der)))
            }
        };
        Ok(BackendMaterial {
            ca,
            client_cert,
            server_name: tls.server_name.clone(),
            fingerprint,
            config: Arc::new(config),
        })
    }

    /// The client configuration, offering `alpn`.
    pub fn client_config(&self, alpn: &[&[u8]]) -> rustls::ClientConfig {
        let mut config = (*self.config).clone();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        config
    }
}

/// The TLS material a configuration names, read and checked: what building (or reloading) it needs besides the
/// configuration itself.
#[derive(Debug, Default)]
pub struct Prepared {
    pub server: Option<ServerMaterial>,
    /// By backend index.
    pub backend_tls: Vec<Option<BackendMaterial>>,
    /// The JWT issuer's public keys, when `[auth.jwt]` names them.
    pub jwt_keys: Option<Arc<crate::guard::JwtKeys>>,
}

impl Prepared {
    /// The backends' TLS material of a configuration already running, for a rebuild that reads no file again.
    pub fn carried(backend_tls: Vec<Option<BackendMaterial>>) -> Prepared {
        Prepared {
            server: None,
            backend_tls,
            jwt_keys: None,
        }
    }

    /// Reads every certificate, key and CA bundle `config` names, and the JWT issuer's key set; every problem is
    /// reported with its key.
    pub fn load(config: &crate::config::Config) -> Result<Prepared, Vec<Problem>> {
        let mut problems = Vec::new();
        let server = config
            .tls
            .as_ref()
            .and_then(|tls| ServerMaterial::load(tls).map_err(|p| problems.push(p)).ok());
        let backend_tls = config
            .backends()
            .iter()
            .enumerate()
            .map(|(index, backend)| {
                backend
                    .tls
                    .as_ref()
                    .and_then(|tls| BackendMaterial::load(tls, index).map_err(|p| problems.push(p)).ok())
            })
            .collect();
        let jwt_keys = config.auth.as_ref().and_then(|auth| auth.jwt.as_ref()).and_then(|jwt| {
            crate::guard::JwtKeys::load(&jwt.jwks_file)
                .map_err(|p| problems.push(p))
                .ok()
        });
        if problems.is_empty() {
            Ok(Prepared {
                server,
                backend_tls,
                jwt_keys,
            })
        } else {
            Err(problems)
        }
    }
}
