//! TLS for the engine's PostgreSQL connections: rustls, with the `ring` provider the HTTP
//! client already uses, and a certificate verifier per libpq `sslmode` (see
//! [`crate::config::TlsMode`]). rustls's own verifier checks chain and host name together;
//! `require` and `verify-ca` need less, so the verifier here wraps it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::SslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::config::{Tls, TlsMode};

/// Why the TLS settings could not be turned into a connector. Raised at start, before any
/// connection.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("database.tls.ca_file {}: {reason}", path.display())]
    CaFile { path: PathBuf, reason: String },
    #[error("TLS setup: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The connector for `tls`, and the `sslmode` tokio-postgres is to apply with it.
pub fn connector(tls: &Tls) -> Result<(MakeRustlsConnect, SslMode), TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = match &tls.ca_file {
        Some(path) => Some(
            WebPkiServerVerifier::builder_with_provider(Arc::new(read_ca(path)?), provider.clone())
                .build()
                .map_err(|e| TlsError::CaFile {
                    path: path.clone(),
                    reason: e.to_string(),
                })?,
        ),
        None => None,
    };
    let verifier = Verifier {
        chain,
        check_name: tls.mode == TlsMode::VerifyFull,
        provider: provider.clone(),
    };
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    let mode = match tls.mode {
        TlsMode::Disable => SslMode::Disable,
        TlsMode::Prefer => SslMode::Prefer,
        TlsMode::Require | TlsMode::VerifyCa | TlsMode::VerifyFull => SslMode::Require,
    };
    Ok((MakeRustlsConnect::new(config), mode))
}

/// Every certificate of a PEM file; none is an error, as a verifier without roots refuses
/// every server with a message that does not say why.
fn read_ca(path: &Path) -> Result<RootCertStore, TlsError> {
    let fail = |reason: String| TlsError::CaFile {
        path: path.to_path_buf(),
        reason,
    };
    let mut roots = RootCertStore::empty();
    // pki-types' own text for a malformed file lists the bytes of the marker it missed.
    let pem = |e: rustls::pki_types::pem::Error| match e {
        rustls::pki_types::pem::Error::Io(e) => fail(e.to_string()),
        rustls::pki_types::pem::Error::MissingSectionEnd { .. } => {
            fail("not a PEM file: a BEGIN line without its END line".into())
        }
        other => fail(format!("not a PEM certificate file ({other:?})")),
    };
    let certs = CertificateDer::pem_file_iter(path).map_err(pem)?;
    for cert in certs {
        let cert = cert.map_err(pem)?;
        roots
            .add(cert)
            .map_err(|e| fail(format!("not a usable CA certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(fail("holds no PEM certificate".into()));
    }
    Ok(roots)
}

/// `chain`: verify the certificate chain against the CA file (`verify-ca`, `verify-full`, and
/// `prefer`/`require` when a CA file is given, as libpq does); none: accept any certificate.
/// The handshake's signatures are always checked, so the server must hold the certificate's key.
#[derive(Debug)]
struct Verifier {
    chain: Option<Arc<WebPkiServerVerifier>>,
    check_name: bool,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            // webpki checks the name only after the chain has verified: this error means the
            // chain is good, which is all verify-ca asks.
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A sentence for an operator when a connection failed for a TLS reason: which setting or
/// certificate to look at. `None` when the failure is not about TLS.
pub fn explain(error: &tokio_postgres::Error, tls: &Tls, host: &str) -> Option<String> {
    let ca = || {
        tls.ca_file
            .as_deref()
            .map_or_else(|| "?".to_string(), |p| p.display().to_string())
    };
    if let Some(db) = error.as_db_error() {
        // pg_hba.conf's "hostssl" lines only, and a client that did not ask for TLS.
        return (tls.mode == TlsMode::Disable && db.message().contains("no encryption")).then(
            || {
                "the server accepts only encrypted connections from this host: set \
                 database.tls.mode (verify-full for production)"
                    .to_string()
            },
        );
    }
    let mut source = std::error::Error::source(error);
    while let Some(e) = source {
        let rustls_error = (e.downcast_ref::<rustls::Error>())
            .or_else(|| (e.downcast_ref::<std::io::Error>()?.get_ref()?).downcast_ref());
        if let Some(rustls::Error::InvalidCertificate(c)) = rustls_error {
            return Some(match c {
                CertificateError::UnknownIssuer | CertificateError::BadSignature => format!(
                    "the server's certificate is not signed by the CA in database.tls.ca_file \
                     ({}): a wrong CA file, or a server with another certificate",
                    ca()
                ),
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => format!(
                    "the server's certificate does not name the host {host:?} that the URL \
                     connects to ({c}): connect by a name the certificate lists, or reissue \
                     it; verify-full checks the name, verify-ca does not"
                ),
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    format!("the server's certificate has expired ({c})")
                }
                other => format!("the server's certificate was refused: {other}"),
            });
        }
        if rustls_error.is_some() {
            return Some(format!("TLS handshake failed (sslmode {})", tls.mode));
        }
        // tokio-postgres's own refusal, when the server answers the TLS request with "no".
        if e.to_string() == "server does not support TLS" {
            return Some(format!(
                "the server does not offer TLS, and database.tls.mode is {:?}: turn `ssl = on` \
                 on the server, or lower the mode",
                tls.mode.as_str()
            ));
        }
        source = e.source();
    }
    None
}
