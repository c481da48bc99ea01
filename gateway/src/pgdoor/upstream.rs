//! The door's leg to the server: a TCP connection to one host of `--database-url`, with
//! TLS as that URL's `sslmode` asks ([`crate::pgtls`]).
//!
//! # Which host
//!
//! The URL may name several hosts (`postgres://db-a:5432,db-b:5432/app`, or
//! `host=db-a,db-b port=5432`, with `hostaddr` too; one port for all or one per host).
//! Each host's TLS checks its own name. The door remembers the host its sessions go to
//! and connects every session there; when it knows none — at start, or after a session
//! could not reach it or found it read-only — it goes through the hosts in the URL's
//! order, as libpq does, and takes the first that answers. A host that refuses, fails
//! the TLS handshake or does not answer within the URL's `connect_timeout`
//! ([`DEFAULT_HOST_TIMEOUT`] without one) is skipped. One search runs at a time:
//! sessions that arrive meanwhile wait for its result. `load_balance_hosts` is ignored.
//!
//! With `target_session_attrs=read-write`, "answers" means "is the primary". A session's
//! authentication is relayed, so once a server has taken the client's login the session
//! cannot move to another one; the door must know the primary before it connects. So
//! the search logs in to each host with the URL's own credentials, through
//! tokio-postgres, which checks `SHOW transaction_read_only` as libpq does, and keeps
//! the first writable host. Each session checks again what its server reports
//! (`in_hot_standby`, `default_transaction_read_only`: Postgres 14 and later), at login
//! and while it lasts ([`super::session`]); a server that is not, or no longer, the
//! primary ends the session and is forgotten, so the next session searches again.
//!
//! # Ordering
//!
//! TLS comes first, the client's StartupMessage after: the door sends SSLRequest and,
//! on `S`, runs a TLS handshake of its own before the session relays a byte (with
//! `sslnegotiation=direct`, the handshake starts at once). On `N` the door goes on in
//! cleartext only if the `sslmode` allows it. The client's TLS, ended at the door, and
//! this one are independent sessions; cancel requests go to the host of the session
//! they cancel, as sessions do.

use std::io;
use std::sync::Mutex;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_postgres::config::{Host, SslMode as Negotiation, SslNegotiation, TargetSessionAttrs};
use tokio_rustls::client::TlsStream;

use super::wire;
use super::DoorStartError;
use crate::pgtls::{self, UpstreamTls};

/// How long a host may take to accept a connection (and TLS, and with
/// `target_session_attrs=read-write` the search's login) when the URL gives no
/// `connect_timeout`: short enough that a host that does not answer leaves the next
/// ones time within `--pg-startup-timeout`.
pub(crate) const DEFAULT_HOST_TIMEOUT: Duration = Duration::from_secs(2);

/// Where upstream connections go, and how.
pub(crate) struct Upstream {
    /// The hosts of `--database-url`, in its order; never empty.
    servers: Vec<Server>,
    tls: UpstreamTls,
    /// TLS at once, without SSLRequest (`sslnegotiation=direct`).
    direct: bool,
    /// `target_session_attrs=read-write`: sessions go to the primary only.
    primary_only: bool,
    /// How long each host may take; see [`DEFAULT_HOST_TIMEOUT`].
    host_timeout: Duration,
    /// The URL's login, without its hosts: what the search logs in with.
    login: tokio_postgres::Config,
    /// The host sessions go to. `current` is only set by a search that found it, and
    /// only cleared by a session that found it unreachable or read-only.
    chosen: Mutex<Chosen>,
    /// Held by the search, so that one runs at a time.
    searching: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Chosen {
    /// The index in `servers` of the host sessions go to; `None`: search first.
    current: Option<usize>,
    /// The host that sessions went to before, to log a switch.
    last: Option<usize>,
}

/// One host of the URL.
struct Server {
    /// The host's name: what a `verify-full` certificate must show.
    host: String,
    /// What the door connects to: the host's `hostaddr` if it has one, else the host.
    addr: String,
    port: u16,
    /// The name TLS checks; `None` when TLS is never used.
    server_name: Option<ServerName<'static>>,
}

/// A connection to the server, in cleartext or over TLS.
pub(crate) enum UpstreamStream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Upstream {
    pub(crate) fn from_url(url: &str) -> Result<Upstream, DoorStartError> {
        let pgtls::PgUrl { config, tls } = pgtls::parse(url)?;
        let hosts = config.get_hosts();
        let hostaddrs = config.get_hostaddrs();
        let ports = config.get_ports();
        let count = hosts.len().max(hostaddrs.len()).max(1);
        if !hosts.is_empty() && !hostaddrs.is_empty() && hosts.len() != hostaddrs.len() {
            return Err(DoorStartError::Hosts(format!(
                "{} hosts but {} hostaddrs",
                hosts.len(),
                hostaddrs.len()
            )));
        }
        if ports.len() > 1 && ports.len() != count {
            return Err(DoorStartError::Hosts(format!(
                "{} ports for {count} hosts: give one port for all, or one per host",
                ports.len()
            )));
        }
        let direct = config.get_ssl_negotiation() == SslNegotiation::Direct;
        let uses_tls = match tls.negotiation() {
            Negotiation::Disable => false,
            Negotiation::Prefer if direct => return Err(DoorStartError::WeakDirect),
            _ => true,
        };
        let servers = (0..count)
            .map(|i| {
                let addr = hostaddrs.get(i).map(ToString::to_string);
                let host = match (hosts.get(i), &addr) {
                    (Some(Host::Tcp(host)), _) => host.clone(),
                    (Some(_), _) => return Err(DoorStartError::UnixSocket),
                    // libpq checks a certificate against the address then.
                    (None, Some(addr)) => addr.clone(),
                    (None, None) => "localhost".to_owned(),
                };
                Ok(Server {
                    server_name: uses_tls.then(|| pgtls::server_name(&host)).transpose()?,
                    addr: addr.unwrap_or_else(|| host.clone()),
                    host,
                    port: ports.get(i).or(ports.first()).copied().unwrap_or(5432),
                })
            })
            .collect::<Result<Vec<_>, DoorStartError>>()?;
        let primary_only = match config.get_target_session_attrs() {
            TargetSessionAttrs::Any => false,
            TargetSessionAttrs::ReadWrite => true,
            _ => return Err(DoorStartError::SessionAttrs),
        };
        Ok(Upstream {
            servers,
            tls,
            direct,
            primary_only,
            host_timeout: config
                .get_connect_timeout()
                .copied()
                .unwrap_or(DEFAULT_HOST_TIMEOUT),
            login: login_of(&config),
            chosen: Mutex::default(),
            searching: tokio::sync::Mutex::new(()),
        })
    }

    /// Whether sessions must be on the primary (`target_session_attrs=read-write`).
    pub(crate) fn primary_only(&self) -> bool {
        self.primary_only
    }

    /// The host `index` (of a session), for the log: `host:port`.
    pub(crate) fn host(&self, index: usize) -> &dyn std::fmt::Display {
        &self.servers[index]
    }

    /// Connects a session: to the host sessions go to, or, if there is none or it does
    /// not answer, to the first host (in the URL's order) that answers — and is the
    /// primary, with `target_session_attrs=read-write`. Returns the host's index.
    pub(crate) async fn connect(&self) -> io::Result<(usize, UpstreamStream)> {
        if let Some(index) = self.current() {
            match self.connect_to(index).await {
                Ok(stream) => return Ok((index, stream)),
                Err(error) => {
                    tracing::info!(
                        host = %self.servers[index],
                        %error,
                        "the Postgres door could not reach its database host; trying the others"
                    );
                    self.forget(index);
                }
            }
        }
        let _searching = self.searching.lock().await;
        if let Some(index) = self.current() {
            // Found by the search this session waited for.
            return match self.connect_to(index).await {
                Ok(stream) => Ok((index, stream)),
                Err(error) => {
                    self.forget(index);
                    Err(error)
                }
            };
        }
        let mut failed = None;
        for index in 0..self.servers.len() {
            let attempt = async {
                if self.primary_only {
                    self.probe(index).await?;
                }
                self.connect_to(index).await
            };
            match attempt.await {
                Ok(stream) => {
                    self.found(index);
                    return Ok((index, stream));
                }
                Err(error) => {
                    tracing::debug!(host = %self.servers[index], %error, "database host skipped");
                    failed = Some(error);
                }
            }
        }
        let failed = failed.expect("a URL has at least one host");
        if !self.primary_only {
            return Err(failed);
        }
        Err(io::Error::new(
            failed.kind(),
            format!("no host is a reachable primary (target_session_attrs=read-write); the last: {failed}"),
        ))
    }

    /// Forgets host `index` as the one sessions go to (a session found it unreachable,
    /// or not the primary): the next session searches.
    pub(crate) fn forget(&self, index: usize) {
        let mut chosen = self.chosen.lock().expect("never poisoned");
        if chosen.current == Some(index) {
            chosen.current = None;
        }
    }

    fn current(&self) -> Option<usize> {
        self.chosen.lock().expect("never poisoned").current
    }

    /// Makes host `index` the one sessions go to, and logs it if it is another than
    /// before.
    fn found(&self, index: usize) {
        let mut chosen = self.chosen.lock().expect("never poisoned");
        chosen.current = Some(index);
        let before = chosen.last.replace(index);
        drop(chosen);
        match before {
            Some(before) if before != index => tracing::info!(
                from = %self.servers[before],
                to = %self.servers[index],
                primary_only = self.primary_only,
                "the Postgres door switched to another database host"
            ),
            _ => {
                tracing::debug!(host = %self.servers[index], "Postgres door sessions go to this database host")
            }
        }
    }

    /// Logs in to host `index` with the URL's credentials and checks that it takes
    /// writes (tokio-postgres's `target_session_attrs=read-write`).
    async fn probe(&self, index: usize) -> io::Result<()> {
        let server = &self.servers[index];
        let mut config = self.login.clone();
        config.host(&server.host).port(server.port);
        if let Ok(addr) = server.addr.parse() {
            config.hostaddr(addr);
        }
        let login = async {
            let (client, connection) =
                config
                    .connect(self.tls.make_tls_connect())
                    .await
                    .map_err(|error| match error.as_db_error() {
                        Some(db) => io::Error::other(db.message().to_owned()),
                        None => io::Error::other(error.to_string()),
                    })?;
            // Dropping the client ends the connection with Terminate.
            drop(client);
            let _ = connection.await;
            Ok(())
        };
        tokio::time::timeout(self.host_timeout, login)
            .await
            .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
    }

    /// Connects to host `index`, and starts TLS if the `sslmode` asks for it and the
    /// server agrees; within the host's timeout.
    async fn connect_to(&self, index: usize) -> io::Result<UpstreamStream> {
        tokio::time::timeout(self.host_timeout, self.connect_once(&self.servers[index]))
            .await
            .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
    }

    async fn connect_once(&self, server: &Server) -> io::Result<UpstreamStream> {
        let mut stream = TcpStream::connect((server.addr.as_str(), server.port)).await?;
        stream.set_nodelay(true)?;
        let Some(name) = &server.server_name else {
            return Ok(UpstreamStream::Plain(stream));
        };
        if !self.direct {
            let mut request = [0u8; 8];
            request[..4].copy_from_slice(&8u32.to_be_bytes());
            request[4..].copy_from_slice(&wire::SSL_REQUEST.to_be_bytes());
            stream.write_all(&request).await?;
            // One byte, unbuffered: nothing the server sends before the handshake may
            // be taken for part of the session.
            match stream.read_u8().await? {
                b'S' => {}
                b'N' if self.tls.negotiation() == Negotiation::Prefer => {
                    return Ok(UpstreamStream::Plain(stream))
                }
                b'N' => {
                    return Err(io::Error::other(format!(
                        "the database offers no TLS, and sslmode={} requires it",
                        self.tls.mode()
                    )))
                }
                other => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("the database answered SSLRequest with {other:#04x}"),
                    ))
                }
            }
        }
        let stream = self.tls.connector().connect(name.clone(), stream).await?;
        Ok(UpstreamStream::Tls(Box::new(stream)))
    }

    /// Sends a CancelRequest for `key` to host `index` (the host of the session it
    /// cancels), over TLS if sessions use it, and waits for the server to close.
    pub(crate) async fn cancel(&self, index: usize, key: &wire::CancelKey) -> io::Result<()> {
        match self.connect_to(index).await? {
            UpstreamStream::Plain(mut stream) => send_cancel(&mut stream, key).await,
            UpstreamStream::Tls(mut stream) => send_cancel(&mut *stream, key).await,
        }
    }
}

/// The login settings of `config`, without its hosts, ports and `target_session_attrs`
/// (the search sets them per host).
fn login_of(config: &tokio_postgres::Config) -> tokio_postgres::Config {
    let mut login = tokio_postgres::Config::new();
    if let Some(user) = config.get_user() {
        login.user(user);
    }
    if let Some(password) = config.get_password() {
        login.password(password);
    }
    if let Some(dbname) = config.get_dbname() {
        login.dbname(dbname);
    }
    if let Some(options) = config.get_options() {
        login.options(options);
    }
    login
        .application_name(
            config
                .get_application_name()
                .unwrap_or("fencegate Postgres door"),
        )
        .ssl_mode(config.get_ssl_mode())
        .ssl_negotiation(config.get_ssl_negotiation())
        .channel_binding(config.get_channel_binding())
        .target_session_attrs(TargetSessionAttrs::ReadWrite);
    login
}

async fn send_cancel<S>(stream: &mut S, key: &wire::CancelKey) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream.write_all(&key.cancel_request()).await?;
    stream.flush().await?;
    // The server reads the request and closes; wait for that, briefly.
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest).await {
        // A server may close its TLS without close_notify: the request was read.
        Err(error) if error.kind() != io::ErrorKind::UnexpectedEof => Err(error),
        _ => Ok(()),
    }
}

impl std::fmt::Display for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// All hosts, `host:port,host:port`.
impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, server) in self.servers.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{server}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each host as `host:port via addr`, and its TLS name.
    fn servers(url: &str) -> Vec<(String, Option<ServerName<'static>>)> {
        let upstream = Upstream::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        upstream
            .servers
            .iter()
            .map(|s| (format!("{s} via {}", s.addr), s.server_name.clone()))
            .collect()
    }

    fn name(host: &str) -> Option<ServerName<'static>> {
        Some(ServerName::try_from(host.to_owned()).unwrap())
    }

    #[test]
    fn every_host_in_order_with_its_port_and_its_own_tls_name() {
        assert_eq!(
            servers("postgres://u@db-a:5433,db-b:5434/app?sslmode=require"),
            [
                ("db-a:5433 via db-a".to_owned(), name("db-a")),
                ("db-b:5434 via db-b".to_owned(), name("db-b")),
            ]
        );
        // One port for all; hostaddrs paired with hosts, whose names TLS checks.
        assert_eq!(
            servers("host=db-a,db-b hostaddr=10.0.0.1,10.0.0.2 port=6432 sslmode=disable user=u"),
            [
                ("db-a:6432 via 10.0.0.1".to_owned(), None),
                ("db-b:6432 via 10.0.0.2".to_owned(), None),
            ]
        );
        // Without hosts, the addresses are the names.
        assert_eq!(
            servers("hostaddr=10.0.0.1 port=6432 sslmode=require user=u"),
            [("10.0.0.1:6432 via 10.0.0.1".to_owned(), name("10.0.0.1"))]
        );
    }

    #[test]
    fn target_session_attrs_any_or_read_write() {
        let primary = |url: &str| Upstream::from_url(url).map(|u| u.primary_only());
        assert!(!primary("postgres://u@db-a,db-b/app").unwrap());
        assert!(!primary("postgres://u@db-a,db-b/app?target_session_attrs=any").unwrap());
        assert!(primary("postgres://u@db-a,db-b/app?target_session_attrs=read-write").unwrap());
        // libpq's `primary` means the same for a door of writers.
        assert!(primary("postgres://u@db-a,db-b/app?target_session_attrs=primary").unwrap());
        assert!(matches!(
            primary("postgres://u@db-a,db-b/app?target_session_attrs=read-only"),
            Err(DoorStartError::Url(_))
        ));
    }

    #[test]
    fn hosts_ports_and_addresses_must_pair_up() {
        for url in [
            "host=db-a,db-b hostaddr=10.0.0.1 user=u",
            "host=db-a,db-b,db-c port=1,2 user=u",
        ] {
            assert!(
                matches!(Upstream::from_url(url), Err(DoorStartError::Hosts(_))),
                "{url}"
            );
        }
    }

    #[test]
    fn only_the_current_host_is_forgotten() {
        let upstream = Upstream::from_url("postgres://u@db-a,db-b/app").unwrap();
        assert_eq!(upstream.current(), None);
        upstream.found(1);
        upstream.forget(0);
        assert_eq!(upstream.current(), Some(1), "an older session's host");
        upstream.forget(1);
        assert_eq!(upstream.current(), None);
    }
}
