//! A minimal HTTP/1.1 GET over a blocking socket, for the commands that read a node's
//! operator endpoints (`quotamesh health`, `quotamesh policy get`): the image has no curl,
//! and these need no runtime. Plain `http://` only, as the metrics port serves; every step is
//! bounded by the timeout. An operator token, when given, goes as `Authorization: Bearer`
//! (`/config` asks for one, as the admin API's reads do).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use std::process::ExitCode;

use anyhow::{Context, bail};

/// Largest response read: `/config` of the largest policy set (2 MiB) and some headers.
const RESPONSE_BYTES_MAX: u64 = 4 * 1024 * 1024;

/// The status code and body of `GET url`, sending `token` as a bearer token if given.
///
/// # Errors
/// An URL that is not `http://host:port/path`, a token that is not one line of printable
/// ASCII, a connection or read that fails or takes longer than `timeout`, or an answer that
/// is not HTTP.
pub fn get(url: &str, token: Option<&str>, timeout: Duration) -> anyhow::Result<(u16, String)> {
    let rest = url
        .strip_prefix("http://")
        .with_context(|| format!("{url:?}: only http://host:port/path URLs are supported"))?;
    let (authority, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_owned()), |(authority, path)| (authority, format!("/{path}")));
    let address = authority
        .to_socket_addrs()
        .with_context(|| format!("{url:?}: cannot resolve {authority:?}"))?
        .next()
        .with_context(|| format!("{url:?}: {authority:?} resolves to no address"))?;
    let authorization = match token {
        Some(token) if token.bytes().all(|byte| byte.is_ascii_graphic()) => {
            format!("Authorization: Bearer {token}\r\n")
        }
        Some(_) => bail!("the operator token must be printable ASCII without spaces"),
        None => String::new(),
    };
    let mut stream = TcpStream::connect_timeout(&address, timeout)
        .with_context(|| format!("cannot connect to {authority}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\n{authorization}Connection: close\r\n\r\n"
    )?;
    let mut response = Vec::new();
    stream
        .take(RESPONSE_BYTES_MAX)
        .read_to_end(&mut response)
        .with_context(|| format!("no complete answer from {authority} within {timeout:?}"))?;
    let text = String::from_utf8_lossy(&response);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!("{authority} did not answer HTTP");
    };
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse::<u16>().ok())
        .with_context(|| format!("{authority} did not answer HTTP"))?;
    Ok((status, body.to_owned()))
}

/// Prints the body of `GET url` and succeeds on 200; any other answer or failure goes to
/// stderr and fails.
pub fn print_answer(url: &str, token: Option<&str>, timeout: Duration) -> ExitCode {
    match get(url, token, timeout) {
        Ok((200, body)) => {
            print!("{body}");
            ExitCode::SUCCESS
        }
        Ok((status, body)) => {
            eprint!("{url} answered {status}: {body}");
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
