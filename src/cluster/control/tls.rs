//! TLS on the control plane (CTL-10): the head presents a certificate, a node checks it
//! against the certificate authorities it trusts, and every control session is encrypted
//! before ractor_cluster's challenge runs on it.
//!
//! The data plane is not encrypted: its connections are admitted by the job token, which the
//! head hands out over the (now encrypted) control plane, but each data-plane link still shows
//! the token in its opening handshake, and the gradients and activations travel in the clear.
//!
//! Certificates and keys are read from PEM files ([`HeadTls::from_pem_files`],
//! [`NodeTls::from_pem_file`]); the crypto is rustls with aws-lc-rs.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ractor_cluster::NetworkStream;
use tokio::net::TcpStream;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::ControlError;

/// How long a TLS handshake may take, on either side.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn provider() -> Arc<CryptoProvider> {
    Arc::new(tokio_rustls::rustls::crypto::aws_lc_rs::default_provider())
}

fn tls_error(what: impl Into<String>, reason: impl std::fmt::Display) -> ControlError {
    ControlError::Tls {
        what: what.into(),
        reason: reason.to_string(),
    }
}

fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, ControlError> {
    let what = || format!("reading the certificates in {}", path.display());
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| tls_error(what(), e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_error(what(), e))?;
    if certs.is_empty() {
        return Err(tls_error(what(), "the file holds no PEM certificate"));
    }
    Ok(certs)
}

/// The head's side of control-plane TLS: its certificate chain and private key.
#[derive(Clone)]
pub struct HeadTls {
    acceptor: TlsAcceptor,
}

impl std::fmt::Debug for HeadTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HeadTls")
    }
}

impl HeadTls {
    /// The head's certificate chain (`cert`: PEM, the head's certificate first) and its
    /// private key (`key`: PEM, PKCS#8, PKCS#1 or SEC1).
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<Self, ControlError> {
        let certs = read_certificates(cert)?;
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| tls_error(format!("reading the private key {}", key.display()), e))?;
        let config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("configuring TLS", e))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| tls_error("pairing the certificate with the key", e))?;
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// Runs the server side of the handshake on an accepted connection, within
    /// [`HANDSHAKE_TIMEOUT`]; the stream to hand to ractor_cluster.
    pub(crate) async fn accept(&self, stream: TcpStream) -> Result<NetworkStream, ControlError> {
        let (peer_addr, local_addr) = addresses(&stream)?;
        nodelay(&stream)?;
        let what = || format!("the TLS handshake with {peer_addr}");
        let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, self.acceptor.accept(stream))
            .await
            .map_err(|_| tls_error(what(), format!("not done within {HANDSHAKE_TIMEOUT:?}")))?
            .map_err(|e| tls_error(what(), e))?;
        Ok(NetworkStream::TlsServer {
            peer_addr,
            local_addr,
            stream,
        })
    }
}

/// A node's side of control-plane TLS: the certificate authorities it trusts to sign the
/// head's certificate, and the name the certificate must carry.
#[derive(Clone)]
pub struct NodeTls {
    connector: TlsConnector,
    server_name: Option<String>,
}

impl std::fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl NodeTls {
    /// Trusts the certificate authorities in `ca` (PEM). The head's certificate must name the
    /// host of the address the node joins (a DNS name or an IP address), unless
    /// [`NodeTls::server_name`] says otherwise.
    pub fn from_pem_file(ca: &Path) -> Result<Self, ControlError> {
        let mut roots = RootCertStore::empty();
        for cert in read_certificates(ca)? {
            roots.add(cert).map_err(|e| {
                tls_error(format!("trusting the certificates in {}", ca.display()), e)
            })?;
        }
        let config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("configuring TLS", e))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self {
            connector: TlsConnector::from(Arc::new(config)),
            server_name: None,
        })
    }

    /// The name the head's certificate must carry, when it is not the host the node joins.
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    /// Runs the client side of the handshake with the head at `head` (`host:port`) within
    /// [`HANDSHAKE_TIMEOUT`]; the stream to hand to ractor_cluster.
    pub(crate) async fn connect(
        &self,
        head: &str,
        stream: TcpStream,
    ) -> Result<NetworkStream, ControlError> {
        let (peer_addr, local_addr) = addresses(&stream)?;
        nodelay(&stream)?;
        let name = match &self.server_name {
            Some(n) => n.clone(),
            None => host_of(head).to_string(),
        };
        let server_name = ServerName::try_from(name.clone())
            .map_err(|e| tls_error(format!("the head's name {name:?}"), e))?;
        let what = || format!("the TLS handshake with the head at {head} (as {name})");
        let plain = "; does the head run with --tls-cert?";
        let stream = tokio::time::timeout(
            HANDSHAKE_TIMEOUT,
            self.connector.connect(server_name, stream),
        )
        .await
        .map_err(|_| {
            tls_error(
                what(),
                format!("not done within {HANDSHAKE_TIMEOUT:?}{plain}"),
            )
        })?
        .map_err(|e| {
            // A head without TLS answers a ClientHello with nothing, or closes.
            let hint = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                plain
            } else {
                ""
            };
            tls_error(what(), format!("{e}{hint}"))
        })?;
        Ok(NetworkStream::TlsClient {
            peer_addr,
            local_addr,
            stream,
        })
    }
}

/// Control requests are small: no Nagle delay (as on plain control streams).
fn nodelay(stream: &TcpStream) -> Result<(), ControlError> {
    stream
        .set_nodelay(true)
        .map_err(|e| ControlError::Runtime(format!("control stream: {e}")))
}

fn addresses(stream: &TcpStream) -> Result<(SocketAddr, SocketAddr), ControlError> {
    let io = |e: std::io::Error| ControlError::Runtime(format!("control stream: {e}"));
    Ok((
        stream.peer_addr().map_err(io)?,
        stream.local_addr().map_err(io)?,
    ))
}

/// The host of `host:port` (`[v6]:port` too), or the whole string without a port.
fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split_once(']').map_or(rest, |(h, _)| h);
    }
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.parse::<u16>().is_ok() => host,
        _ => addr,
    }
}

#[cfg(test)]
mod tests {
    use super::host_of;

    #[test]
    fn the_host_of_an_address_is_what_the_certificate_must_name() {
        assert_eq!(host_of("127.0.0.1:4000"), "127.0.0.1");
        assert_eq!(host_of("head.example:4000"), "head.example");
        assert_eq!(host_of("[::1]:4000"), "::1");
        assert_eq!(host_of("head.example"), "head.example");
        assert_eq!(host_of("::1"), "::1");
    }
}
