//! `bcd status` and `bcd update`: the running agent answers on a unix socket in `data_dir`
//! (`bcd.sock`, mode 0600: its owner only). A client that sends nothing (it shuts its writing
//! half at once, as [`query`] does) is answered one JSON document, the status, then closed. A
//! client that sends one line `{"update": {"manifest": …, "signature": …}}` ([`request_update`])
//! has the agent take that release by hand, and is answered `{"ok": …}` or `{"error": …}`.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use crate::driver::Status;
use crate::update::UpdateArgs;

/// A client that takes longer to read the answer is dropped.
const ANSWER_TIMEOUT_MS: u64 = 2_000;
/// How long a client has to send its request (or close its writing half).
const REQUEST_TIMEOUT_MS: u64 = 2_000;
/// The largest request: a manifest and its signature, with room for JSON's escapes.
pub const REQUEST_BYTES_MAX: usize = 32 * 1024;
/// How long `bcd update` waits for the agent's answer: the artifact's fetch and the switch.
pub const UPDATE_ANSWER_TIMEOUT_S: u64 = crate::update::ARTIFACT_FETCH_TIMEOUT_S + 30;

/// An update asked for by hand: the release, where the answer goes, and where the socket says
/// it wrote the answer (so the agent re-executes only after).
pub struct UpdateRequest {
    pub args: UpdateArgs,
    pub reply: oneshot::Sender<Result<String, String>>,
    pub written: oneshot::Receiver<()>,
}

#[derive(Serialize, Deserialize)]
struct Request {
    update: RequestUpdate,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestUpdate {
    manifest: String,
    signature: String,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Answer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ok: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// Binds the socket (replacing a stale one) and answers every connection: the status, or an
/// update request handed to `updates` (none: refused `update-unconfigured`).
pub fn serve(
    path: &Path,
    status: Arc<Mutex<Status>>,
    updates: Option<mpsc::Sender<UpdateRequest>>,
) -> Result<tokio::task::JoinHandle<()>, String> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(format!("{} is in use: another bcd node runs on this data directory", path.display()));
        }
        std::fs::remove_file(path).map_err(|e| format!("removing the stale {}: {e}", path.display()))?;
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(|e| format!("binding {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else { continue };
            let (status, updates) = (status.clone(), updates.clone());
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut limited = (&mut stream).take(REQUEST_BYTES_MAX as u64 + 1);
                let _ = tokio::time::timeout(Duration::from_millis(REQUEST_TIMEOUT_MS), limited.read_to_end(&mut request)).await;
                let mut written = None;
                let body = if request.iter().all(u8::is_ascii_whitespace) {
                    serde_json::to_vec(&*status.lock().expect("status lock")).unwrap_or_default()
                } else {
                    let (answer, done) = answer_update(&request, updates).await;
                    written = done;
                    serde_json::to_vec(&answer).unwrap_or_default()
                };
                let write = async {
                    stream.write_all(&body).await?;
                    stream.write_all(b"\n").await?;
                    stream.shutdown().await
                };
                let _ = tokio::time::timeout(Duration::from_millis(ANSWER_TIMEOUT_MS), write).await;
                if let Some(done) = written {
                    let _ = done.send(());
                }
            });
        }
    }))
}

async fn answer_update(request: &[u8], updates: Option<mpsc::Sender<UpdateRequest>>) -> (Answer, Option<oneshot::Sender<()>>) {
    let error = |e: String| (Answer { ok: None, error: Some(e) }, None);
    if request.len() > REQUEST_BYTES_MAX {
        return error(format!("bad-request: over {REQUEST_BYTES_MAX} bytes"));
    }
    let Ok(Request { update }) = serde_json::from_slice::<Request>(request) else {
        return error("bad-request: not {\"update\": {\"manifest\", \"signature\"}}".into());
    };
    let Some(updates) = updates else { return error(crate::update::UPDATE_UNCONFIGURED.into()) };
    let (reply, answer) = oneshot::channel();
    let (done, written) = oneshot::channel();
    let args = UpdateArgs { manifest: update.manifest, signature: update.signature, rollout_id: None };
    if updates.try_send(UpdateRequest { args, reply, written }).is_err() {
        return error("update-in-progress: another update is being handled".into());
    }
    match tokio::time::timeout(Duration::from_secs(UPDATE_ANSWER_TIMEOUT_S), answer).await {
        Ok(Ok(Ok(message))) => (Answer { ok: Some(message), error: None }, Some(done)),
        Ok(Ok(Err(reason))) => error(reason),
        _ => error("update-failed: the agent did not answer".into()),
    }
}

/// The status of the agent on `path`.
pub fn query(path: &Path) -> Result<serde_json::Value, String> {
    use std::io::Read;
    let stream = std::os::unix::net::UnixStream::connect(path)
        .map_err(|e| format!("cannot reach bcd at {}: {e} (hint: is bcd node running on this data_dir?)", path.display()))?;
    stream.shutdown(std::net::Shutdown::Write).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(std::time::Duration::from_millis(ANSWER_TIMEOUT_MS))).map_err(|e| e.to_string())?;
    let mut text = String::new();
    stream.take(1 << 20).read_to_string(&mut text).map_err(|e| format!("reading {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("bcd answered something that is not JSON: {e}"))
}

/// Hands a release to the agent on `path` (`bcd update`): its answer, or why not.
pub fn request_update(path: &Path, args: &UpdateArgs) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(path).map_err(|e| {
        format!("cannot reach bcd at {}: {e} (hint: bcd update hands the release to a running bcd node)", path.display())
    })?;
    let request = Request { update: RequestUpdate { manifest: args.manifest.clone(), signature: args.signature.clone() } };
    let mut line = serde_json::to_vec(&request).map_err(|e| e.to_string())?;
    line.push(b'\n');
    stream.write_all(&line).map_err(|e| e.to_string())?;
    stream.shutdown(std::net::Shutdown::Write).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(UPDATE_ANSWER_TIMEOUT_S + 5))).map_err(|e| e.to_string())?;
    let mut text = String::new();
    stream.take(1 << 20).read_to_string(&mut text).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let answer: Answer = serde_json::from_str(&text).map_err(|e| format!("bcd answered something that is not JSON: {e}"))?;
    match (answer.ok, answer.error) {
        (Some(ok), None) => Ok(ok),
        (_, Some(error)) => Err(error),
        _ => Err("bcd answered neither ok nor error".into()),
    }
}
