//! `forward`: a port of a running instance on a local port, like `ssh -L` (`schema/TUNNELS.md`).
//! It listens on `--bind` (default `127.0.0.1`) at `--local-port` (default `--port`; `0` picks a
//! free one, printed) and carries each accepted connection over a `tcp` tunnel of its own: a
//! fresh `tunnels.open` per connection, then its WebSocket ([`crate::tunnel::pump`], whose
//! bounds keep each connection's memory bounded). It runs until Ctrl-C (or SIGTERM), exit 0.
//!
//! Invariants: the token is resolved and the URL checked before anything listens; a connection
//! that cannot be opened is closed with a note on stderr, and the others go on; at most
//! [`CONNECTIONS_MAX`] connections are carried at once (more are closed with a note).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use bc_core::id::InstanceId;
use clap::Args;
use serde_json::{Map, Value, json};

use super::{Context, check_id};
use crate::client::{CliError, Client};
use crate::tunnel::{self, Held, PumpEnd};

/// Local connections carried at once (each holds at most a few MiB, see `crate::tunnel`); the
/// server bounds the tunnels of a key and a node below this by default.
pub const CONNECTIONS_MAX: usize = 64;

#[derive(Args, Debug)]
pub struct ForwardArgs {
    /// The running instance whose port is forwarded.
    #[arg(long, value_name = "INSTANCE_ID")]
    pub instance: String,
    /// The instance's port.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,
    /// The local port to listen on (default: the same as --port; 0 picks a free one).
    #[arg(long)]
    pub local_port: Option<u16>,
    /// The local address to listen on. Another than loopback lets anyone who reaches it use
    /// your access.
    #[arg(long, default_value = "127.0.0.1")]
    pub bind: IpAddr,
}

/// What every connection of one `forward` shares.
struct Forwarding {
    client: Client,
    http: reqwest::Client,
    api: url::Url,
    token: String,
    body: Map<String, Value>,
}

pub async fn run(ctx: &Context, args: ForwardArgs) -> Result<(), CliError> {
    let instance = check_id::<InstanceId>("--instance", &args.instance)?;
    let api = crate::client::api_url(&ctx.global.url)?;
    let token = crate::credentials::token(&ctx.global.url)?;
    let mut body = ctx.tenant_body()?;
    body.insert("op".into(), json!("tcp"));
    body.insert("instanceId".into(), json!(instance));
    body.insert("port".into(), json!(args.port));
    let forwarding = Arc::new(Forwarding {
        client: Client::new(&ctx.global.url, Some(token.clone()))?,
        http: tunnel::upgrade_client(&api)?,
        api,
        token,
        body,
    });
    let wanted = SocketAddr::new(args.bind, args.local_port.unwrap_or(args.port));
    let listener = tokio::net::TcpListener::bind(wanted)
        .await
        .map_err(|e| CliError::new("UNAVAILABLE", format!("cannot listen on {wanted}: {e}")))?;
    let local = listener.local_addr().map_err(|e| CliError::new("INTERNAL", format!("the listening address: {e}")))?;
    eprintln!("forwarding {local} to port {} of {instance} (Ctrl-C stops)", args.port);
    if !args.bind.is_loopback() {
        eprintln!("forward: {} is not a loopback address: whoever reaches it uses your access", args.bind);
    }
    let slots = Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_MAX));
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| CliError::new("INTERNAL", format!("watching for SIGTERM: {e}")))?;
    loop {
        let (connection, peer) = tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = terminate.recv() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    eprintln!("forward: accepting a connection failed: {e}");
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            eprintln!("forward: connection from {peer} closed: {CONNECTIONS_MAX} connections are open, the most forward carries");
            continue;
        };
        let forwarding = forwarding.clone();
        tokio::spawn(async move {
            let _slot = slot;
            if let Some(note) = carry(&forwarding, connection).await {
                eprintln!("forward: connection from {peer} closed: {note}");
            }
        });
    }
    eprintln!("forward: stopped");
    Ok(())
}

/// Opens a tunnel for one accepted connection and carries it; a note when it could not be
/// opened or ended otherwise than closed.
async fn carry(forwarding: &Forwarding, connection: tokio::net::TcpStream) -> Option<String> {
    let _ = connection.set_nodelay(true);
    let socket = async {
        let answer = forwarding.client.call("tunnels.open", &Value::Object(forwarding.body.clone()), None).await?;
        let ticket = tunnel::ticket_of(&answer)?;
        tunnel::connect(&forwarding.http, &forwarding.api, &ticket, &forwarding.token).await
    };
    let socket = match socket.await {
        Ok(socket) => socket,
        Err(e) => return Some(format!("{}: {}", e.code, crate::output::safe_text(&e.message))),
    };
    match tunnel::pump(connection, socket, Arc::new(Held::default()), Arc::new(Held::default())).await {
        PumpEnd::Closed | PumpEnd::LocalGone => None,
        PumpEnd::Failed(why) => Some(format!("the tunnel ended: {}", crate::output::safe_text(&why))),
    }
}
