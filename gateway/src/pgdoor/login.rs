//! Authentication, relayed: the server asks, the client answers, the door passes both
//! on — and withdraws SCRAM channel binding, and puts its own cancel key in place of
//! the server's.

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::cancel::Issued;
use super::session::{error_code, forward, refuse, Ends};
use super::wire::{self, auth, backend, frontend, ProtocolError, WireError};
use super::Door;

pub(super) enum Login {
    /// Authenticated; the session's cancel key (held until the session ends, with the
    /// upstream key it stands for) and the first transaction status.
    Ready {
        key: Option<(Issued, wire::CancelKey)>,
        status: u8,
    },
    /// The server refused the session with an error, relayed to the client.
    Refused,
}

/// Relays authentication between the client and the server until the server's first
/// ReadyForQuery, or its error.
pub(super) async fn authenticate<CR, CW, UR, UW>(
    door: &Door,
    ends: &mut Ends<'_, CR, CW, UR, UW>,
) -> Result<Login, WireError>
where
    CR: AsyncRead + Unpin,
    CW: AsyncWrite + Unpin,
    UR: AsyncRead + Unpin,
    UW: AsyncWrite + Unpin,
{
    let mut key = None;
    loop {
        let Some(header) = wire::read_header(
            ends.upstream_read,
            wire::MAX_INSPECTED_MESSAGE,
            "server message",
        )
        .await?
        else {
            return Ok(Login::Refused);
        };
        let body = wire::read_body(ends.upstream_read, header).await?;
        match header.tag {
            backend::AUTHENTICATION => {
                let code = wire::auth_code(&body).ok_or(ProtocolError::Malformed(
                    "authentication request from the server",
                ))?;
                match code {
                    auth::OK | auth::SASL_FINAL => {
                        forward(ends.client_write, header, &body).await?
                    }
                    auth::CLEARTEXT_PASSWORD | auth::MD5_PASSWORD | auth::SASL_CONTINUE => {
                        forward(ends.client_write, header, &body).await?;
                        relay_response(ends).await?;
                    }
                    auth::SASL => {
                        let offered = wire::without_channel_binding(&body).unwrap_or(body);
                        forward(ends.client_write, header, &offered).await?;
                        relay_response(ends).await?;
                    }
                    other => {
                        door.metrics().pg_auth_failure();
                        let text = format!(
                            "authentication method {other} (GSSAPI, SSPI or Kerberos) cannot be relayed by \
                             fencegate's Postgres door; use scram-sha-256, md5, password or trust for \
                             the gateway's address in pg_hba.conf"
                        );
                        refuse(ends.client_write, "28000", &text).await?;
                        return Ok(Login::Refused);
                    }
                }
            }
            backend::BACKEND_KEY_DATA => {
                let upstream = wire::CancelKey::parse(&body)
                    .ok_or(ProtocolError::Malformed("BackendKeyData from the server"))?;
                let (ours, issued) = door.keys.issue(upstream.clone());
                key = Some((issued, upstream));
                ends.client_write
                    .write_all(&ours.backend_key_data())
                    .await?;
            }
            backend::ERROR_RESPONSE => {
                if error_code(&body).is_some_and(|code| code.starts_with(b"28")) {
                    door.metrics().pg_auth_failure();
                }
                forward(ends.client_write, header, &body).await?;
                ends.client_write.flush().await?;
                return Ok(Login::Refused);
            }
            backend::READY_FOR_QUERY => {
                forward(ends.client_write, header, &body).await?;
                ends.client_write.flush().await?;
                let status = body.first().copied().unwrap_or(b'I');
                return Ok(Login::Ready { key, status });
            }
            // ParameterStatus, NoticeResponse, NegotiateProtocolVersion.
            _ => forward(ends.client_write, header, &body).await?,
        }
    }
}

/// Waits for the client's answer to an authentication request and passes it on.
async fn relay_response<CR, CW, UR, UW>(
    ends: &mut Ends<'_, CR, CW, UR, UW>,
) -> Result<(), WireError>
where
    CR: AsyncRead + Unpin,
    CW: AsyncWrite + Unpin,
    UW: AsyncWrite + Unpin,
{
    ends.client_write.flush().await?;
    let header = wire::read_header(
        ends.client_read,
        wire::MAX_AUTH_MESSAGE,
        "authentication message",
    )
    .await?
    .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
    if header.tag != frontend::PASSWORD {
        return Err(ProtocolError::UnexpectedType(header.tag).into());
    }
    let body = wire::read_body(ends.client_read, header).await?;
    forward(ends.upstream_write, header, &body).await?;
    ends.upstream_write.flush().await?;
    Ok(())
}
