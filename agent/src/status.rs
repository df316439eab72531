//! `bcd status`: the running agent answers one JSON document on a unix socket in `data_dir`
//! (`bcd.sock`, mode 0600: its owner only), then closes.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use tokio::io::AsyncWriteExt;

use crate::driver::Status;

/// A client that takes longer to read the answer is dropped.
const ANSWER_TIMEOUT_MS: u64 = 2_000;

/// Binds the socket (replacing a stale one) and answers every connection with `status`.
pub fn serve(path: &Path, status: Arc<Mutex<Status>>) -> Result<tokio::task::JoinHandle<()>, String> {
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
            let body = serde_json::to_vec(&*status.lock().expect("status lock")).unwrap_or_default();
            tokio::spawn(async move {
                let write = async {
                    stream.write_all(&body).await?;
                    stream.write_all(b"\n").await?;
                    stream.shutdown().await
                };
                let _ = tokio::time::timeout(std::time::Duration::from_millis(ANSWER_TIMEOUT_MS), write).await;
            });
        }
    }))
}

/// The status of the agent on `path`.
pub fn query(path: &Path) -> Result<serde_json::Value, String> {
    use std::io::Read;
    let stream = std::os::unix::net::UnixStream::connect(path)
        .map_err(|e| format!("cannot reach bcd at {}: {e} (hint: is bcd node running on this data_dir?)", path.display()))?;
    stream.set_read_timeout(Some(std::time::Duration::from_millis(ANSWER_TIMEOUT_MS))).map_err(|e| e.to_string())?;
    let mut text = String::new();
    stream.take(1 << 20).read_to_string(&mut text).map_err(|e| format!("reading {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("bcd answered something that is not JSON: {e}"))
}
