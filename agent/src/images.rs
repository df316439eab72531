//! The node's image cache: disk images an instance boots from, fetched over HTTP(S) into
//! `<data_dir>/images/<sha256>` and named by their digest, so one fetched and verified is reused
//! by every instance that names it.
//!
//! A fetch streams into a fresh file of its own, `<sha256>.<pid>-<n>.partial` (created
//! `O_EXCL | O_NOFOLLOW`, so two fetches of one image never write one file), hashing (SHA-256)
//! and counting as it goes; past the
//! size it may have ([`IMAGE_BYTES_MAX`], or the `sizeBytes` the image was registered with) it
//! stops. Only a file whose digest is the one asked for is synced and renamed to its name; any
//! failure removes the partial file, so nothing but verified images is ever under a digest's
//! name. The whole fetch is bounded in time ([`IMAGE_FETCH_TIMEOUT_S`], within the command's
//! deadline), and so are redirects ([`IMAGE_REDIRECTS_MAX`], never from `https` to `http`).
//!
//! Errors carry the stable codes of the instances protocol: `image-fetch` (the transfer),
//! `image-digest` (the bytes are not the image), `image-size` (more, or other, than allowed),
//! and `disk` (the node's own files). No URL is ever put in a message or a log line whole: a
//! presigned URL's query is a credential, so only its host is named.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt as _;

use crate::instances::ImageRef;

/// The largest image the node fetches.
pub const IMAGE_BYTES_MAX: u64 = 64 * 1024 * 1024 * 1024;
/// The longest a whole fetch may take: within `instance.apply`'s deadline (900 s), leaving time
/// to copy the disk and start the domain.
pub const IMAGE_FETCH_TIMEOUT_S: u64 = 720;
/// The longest a connection may take to open, and a read may stall.
pub const IMAGE_CONNECT_TIMEOUT_S: u64 = 30;
pub const IMAGE_READ_TIMEOUT_S: u64 = 60;
/// Redirects followed at most.
pub const IMAGE_REDIRECTS_MAX: usize = 5;
/// The protocol's `INSTANCE_APPLY_DEADLINE_S`: the deadline an image fetch runs within.
pub const INSTANCE_APPLY_DEADLINE_S: u64 = 900;

const _: () = assert!(IMAGE_FETCH_TIMEOUT_S < INSTANCE_APPLY_DEADLINE_S);
const _: () = assert!(IMAGE_CONNECT_TIMEOUT_S < IMAGE_FETCH_TIMEOUT_S && IMAGE_READ_TIMEOUT_S < IMAGE_FETCH_TIMEOUT_S);

/// Why an image is not in the cache.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    #[error("image-fetch: {0}")]
    Fetch(String),
    #[error("image-digest: {0}")]
    Digest(String),
    #[error("image-size: {0}")]
    Size(String),
    #[error("disk: {0}")]
    Disk(String),
}

impl ImageError {
    /// The stable code a report carries.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Fetch(_) => "image-fetch",
            Self::Digest(_) => "image-digest",
            Self::Size(_) => "image-size",
            Self::Disk(_) => "disk",
        }
    }
}

/// The images in `<data_dir>/images`, and the HTTP client that fetches them.
pub struct ImageCache {
    dir: PathBuf,
    http: reqwest::Client,
}

/// The host a URL names (never its path or query, which may hold a credential).
fn host_of(url: &reqwest::Url) -> String {
    url.host_str().map(|h| bc_core::id::truncate(h, 100)).unwrap_or_else(|| "?".into())
}

/// A transfer error without its URL.
pub(crate) fn fetch_error(e: reqwest::Error, host: &str) -> ImageError {
    let what = if e.is_timeout() {
        format!("timed out (the whole fetch has its bound, a read {IMAGE_READ_TIMEOUT_S} s)")
    } else if e.is_redirect() {
        format!("too many redirects, or one from https to http (at most {IMAGE_REDIRECTS_MAX})")
    } else if e.is_connect() {
        "could not connect".into()
    } else {
        // reqwest's message names the URL; without it, it says what failed.
        e.without_url().to_string()
    };
    ImageError::Fetch(format!("fetching from {host}: {}", bc_core::id::truncate(&what, 300)))
}

impl ImageCache {
    /// The cache in `<data_dir>/images` (made, 0700, when first written).
    pub fn new(data_dir: &Path) -> Result<Self, String> {
        let http = http_client(IMAGE_FETCH_TIMEOUT_S)?;
        Ok(Self { dir: data_dir.join("images"), http })
    }

    /// Where the image of digest `sha256` is (or will be).
    pub fn path_of(&self, sha256: &str) -> PathBuf {
        self.dir.join(sha256)
    }

    /// The image in the cache: the file already there under its digest, or fetched, verified
    /// and put there now.
    pub async fn fetch(&self, image: &ImageRef) -> Result<PathBuf, ImageError> {
        if !crate::instances::is_sha256(&image.sha256) {
            return Err(ImageError::Digest("the digest is not 64 lowercase hex digits".into()));
        }
        let path = self.path_of(&image.sha256);
        if tokio::fs::try_exists(&path).await.map_err(|e| ImageError::Disk(format!("{}: {e}", path.display())))? {
            return Ok(path);
        }
        create_private_dir(&self.dir).await?;
        // A fresh file of this fetch's own: two fetches of one image at once never write into
        // one file; each is verified and renamed whole (the same bytes, whichever lands last).
        let temp = self.download(image).await?;
        let renamed = async {
            tokio::fs::rename(&temp, &path).await?;
            tokio::fs::File::open(&self.dir).await?.sync_all().await
        };
        if let Err(e) = renamed.await {
            let _ = tokio::fs::remove_file(&temp).await;
            return Err(ImageError::Disk(format!("{}: {e}", path.display())));
        }
        tracing::info!(image = %bc_core::id::truncate(&image.image_id, 40), "image fetched and verified");
        Ok(path)
    }

    /// Streams the image into a fresh file, hashing and counting, and checks it; synced.
    async fn download(&self, image: &ImageRef) -> Result<PathBuf, ImageError> {
        if image.size_bytes.is_some_and(|n| n > IMAGE_BYTES_MAX) {
            return Err(ImageError::Size(format!("the image is registered at over {IMAGE_BYTES_MAX} bytes, this node's bound")));
        }
        let wanted = Wanted {
            what: "image",
            url: &image.url,
            sha256: &image.sha256,
            size_bytes: image.size_bytes,
            limit: IMAGE_BYTES_MAX,
        };
        download(&self.http, &wanted, &self.dir, &image.sha256).await
    }
}

/// What [`download`] fetches: a file by URL, its SHA-256, its size if known, and the most it
/// may have.
pub(crate) struct Wanted<'a> {
    /// What it is, in messages (`image`, `artifact`).
    pub what: &'a str,
    pub url: &'a str,
    pub sha256: &'a str,
    pub size_bytes: Option<u64>,
    pub limit: u64,
}

/// The client of bounded fetches: the whole transfer within `fetch_timeout_s`, a connection and
/// a stalled read bounded too, redirects at most [`IMAGE_REDIRECTS_MAX`] and never from https
/// to http.
pub(crate) fn http_client(fetch_timeout_s: u64) -> Result<reqwest::Client, String> {
    // reqwest's rustls has no crypto provider of its own: ring, as everywhere in this crate
    // (`main` installs it too; this is for a client made in a test).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let redirects = reqwest::redirect::Policy::custom(|attempt| {
        let downgrade = attempt.url().scheme() == "http" && attempt.previous().iter().any(|u| u.scheme() == "https");
        if attempt.previous().len() > IMAGE_REDIRECTS_MAX || downgrade {
            attempt.error("refused redirect")
        } else {
            attempt.follow()
        }
    });
    reqwest::Client::builder()
        .timeout(Duration::from_secs(fetch_timeout_s))
        .connect_timeout(Duration::from_secs(IMAGE_CONNECT_TIMEOUT_S))
        .read_timeout(Duration::from_secs(IMAGE_READ_TIMEOUT_S))
        .redirect(redirects)
        .user_agent(concat!("bcd/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("the HTTP client: {e}"))
}

/// The suffix of a fetch in progress: `<stem>.<pid>-<n>.partial`.
pub const PARTIAL_SUFFIX: &str = ".partial";
/// Fresh names tried at most before a fetch gives up (each is new unless a file of a crashed
/// process of the same pid is left).
pub const FRESH_NAME_ATTEMPTS_MAX: u32 = 16;

/// Creates a file in `dir` that is this call's alone: `<stem>.<pid>-<n>.partial`, 0600, opened
/// `O_CREAT | O_EXCL | O_NOFOLLOW`, so never a file or a link that was there already, and never
/// one another fetch (in this process or another) writes too.
pub(crate) fn create_fresh(dir: &Path, stem: &str) -> std::io::Result<(std::fs::File, PathBuf)> {
    use std::os::unix::fs::OpenOptionsExt as _;
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut last = None;
    for _ in 0..FRESH_NAME_ATTEMPTS_MAX {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!("{stem}.{}-{n}{PARTIAL_SUFFIX}", std::process::id()));
        match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).custom_flags(no_follow_flag()).open(&path) {
            Ok(file) => return Ok((file, path)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no fresh name")))
}

/// `O_NOFOLLOW`, for `OpenOptionsExt::custom_flags` (through rustix: no unsafe code, no libc).
pub(crate) fn no_follow_flag() -> i32 {
    rustix::fs::OFlags::NOFOLLOW.bits() as i32
}

/// Streams `wanted` into a fresh file in `dir` ([`create_fresh`], named after `stem`), hashing
/// and counting the bytes as they are written to it, and checks them; synced. Returns the
/// file's path, for the caller to rename (and remove if that fails); on an error nothing is
/// left behind.
pub(crate) async fn download(http: &reqwest::Client, wanted: &Wanted<'_>, dir: &Path, stem: &str) -> Result<PathBuf, ImageError> {
    let (file, temp) = create_fresh(dir, stem).map_err(|e| ImageError::Disk(format!("{}: {e}", dir.display())))?;
    let fetched = download_into(http, wanted, tokio::fs::File::from_std(file), &temp).await;
    if fetched.is_err() {
        let _ = tokio::fs::remove_file(&temp).await;
    }
    fetched.map(|()| temp)
}

async fn download_into(
    http: &reqwest::Client,
    wanted: &Wanted<'_>,
    mut file: tokio::fs::File,
    partial: &Path,
) -> Result<(), ImageError> {
    let what = wanted.what;
    let url = reqwest::Url::parse(wanted.url).map_err(|_| ImageError::Fetch(format!("the {what} URL does not parse")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(ImageError::Fetch(format!("the {what} URL is {}:, not http(s):", bc_core::id::truncate(url.scheme(), 20))));
    }
    let host = host_of(&url);
    let limit = wanted.size_bytes.unwrap_or(wanted.limit).min(wanted.limit);
    let mut response = http.get(url).send().await.map_err(|e| fetch_error(e, &host))?;
    if !response.status().is_success() {
        return Err(ImageError::Fetch(format!("{host} answered HTTP {}", response.status().as_u16())));
    }
    if let Some(length) = response.content_length()
        && (length > limit || wanted.size_bytes.is_some_and(|n| n != length))
    {
        return Err(ImageError::Size(format!("{host} sends {length} bytes; the {what} may have {limit}")));
    }
    let disk = |e: std::io::Error| ImageError::Disk(format!("{}: {e}", partial.display()));
    let mut hasher = Sha256::new();
    let mut total = 0u64;
    while let Some(chunk) = response.chunk().await.map_err(|e| fetch_error(e, &host))? {
        total = total.saturating_add(chunk.len() as u64);
        if total > limit {
            return Err(ImageError::Size(format!("{host} sent over {limit} bytes, the most the {what} may have")));
        }
        hasher.update(&chunk);
        file.write_all(&chunk).await.map_err(disk)?;
    }
    if let Some(expected) = wanted.size_bytes
        && total != expected
    {
        return Err(ImageError::Size(format!("{host} sent {total} bytes; the {what} has {expected}")));
    }
    let digest = hex::encode(hasher.finalize());
    if digest != wanted.sha256 {
        return Err(ImageError::Digest(format!(
            "the {total} bytes from {host} have SHA-256 {digest}, not the {what}'s {}",
            wanted.sha256
        )));
    }
    file.sync_all().await.map_err(disk)?;
    Ok(())
}

async fn create_private_dir(dir: &Path) -> Result<(), ImageError> {
    let mut builder = tokio::fs::DirBuilder::new();
    builder.recursive(true).mode(0o700);
    builder.create(dir).await.map_err(|e| ImageError::Disk(format!("{}: {e}", dir.display())))
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::AsyncReadExt as _;

    use super::*;
    use crate::instances::DiskFormat;

    /// A loopback HTTP/1.1 server for one image at `/image`: counts the requests it answers.
    pub(crate) struct ImageServer {
        pub url: String,
        pub requests: Arc<AtomicUsize>,
    }

    /// The largest request head the test server reads.
    const REQUEST_HEAD_BYTES_MAX: usize = 16 * 1024;

    impl ImageServer {
        pub(crate) async fn start(body: Vec<u8>) -> Self {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}/image?signature=secret", listener.local_addr().unwrap());
            let requests = Arc::new(AtomicUsize::new(0));
            let (body, counter) = (Arc::new(body), requests.clone());
            tokio::spawn(async move {
                while let Ok((mut stream, _)) = listener.accept().await {
                    let (body, counter) = (body.clone(), counter.clone());
                    tokio::spawn(async move {
                        let mut head = Vec::new();
                        let mut buf = [0u8; 1024];
                        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < REQUEST_HEAD_BYTES_MAX {
                            match stream.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => head.extend_from_slice(&buf[..n]),
                            }
                        }
                        counter.fetch_add(1, Ordering::SeqCst);
                        let found = head.starts_with(b"GET /image");
                        let answer = if found {
                            let mut a = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len())
                                .into_bytes();
                            a.extend_from_slice(&body);
                            a
                        } else {
                            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec()
                        };
                        let _ = stream.write_all(&answer).await;
                        let _ = stream.shutdown().await;
                    });
                }
            });
            Self { url, requests }
        }

        pub(crate) fn requests(&self) -> usize {
            self.requests.load(Ordering::SeqCst)
        }
    }

    pub(crate) fn sha256_of(bytes: &[u8]) -> String {
        hex::encode(Sha256::digest(bytes))
    }

    pub(crate) fn image(url: &str, sha256: &str, size_bytes: Option<u64>) -> ImageRef {
        ImageRef {
            image_id: "img_01J00000000000000000000000".into(),
            url: url.into(),
            sha256: sha256.into(),
            disk_format: DiskFormat::Raw,
            size_bytes,
        }
    }

    #[tokio::test]
    async fn an_image_is_fetched_verified_and_then_reused_by_its_digest() {
        let body = b"a bootable disk, honestly".repeat(1000);
        let server = ImageServer::start(body.clone()).await;
        let dir = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(dir.path()).unwrap();
        let wanted = image(&server.url, &sha256_of(&body), Some(body.len() as u64));
        let path = cache.fetch(&wanted).await.unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), body);
        assert_eq!(path, dir.path().join("images").join(&wanted.sha256));
        assert_eq!(cache.fetch(&wanted).await.unwrap(), path);
        assert_eq!(server.requests(), 1, "the second fetch is the cached file");
    }

    #[tokio::test]
    async fn a_wrong_digest_or_size_is_refused_and_leaves_no_file() {
        let body = b"not the image you registered".to_vec();
        let server = ImageServer::start(body.clone()).await;
        let dir = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(dir.path()).unwrap();
        let other = sha256_of(b"the image you registered");
        let refused = cache.fetch(&image(&server.url, &other, None)).await.unwrap_err();
        assert_eq!(refused.code(), "image-digest", "{refused}");
        assert!(!refused.to_string().contains("secret"), "no URL query in a message: {refused}");
        let left: Vec<_> = std::fs::read_dir(dir.path().join("images")).unwrap().collect();
        assert!(left.is_empty(), "nothing left behind: {left:?}");

        let digest = sha256_of(&body);
        let short = cache.fetch(&image(&server.url, &digest, Some(3))).await.unwrap_err();
        assert_eq!(short.code(), "image-size", "{short}");
        let too_big = cache.fetch(&image(&server.url, &digest, Some(IMAGE_BYTES_MAX + 1))).await.unwrap_err();
        assert_eq!(too_big.code(), "image-size", "{too_big}");
        let missing = cache.fetch(&image(&server.url.replace("/image", "/nothing"), &digest, None)).await.unwrap_err();
        assert!(missing.to_string().starts_with("image-fetch: ") && missing.to_string().contains("404"), "{missing}");
        let unreachable = cache.fetch(&image("http://127.0.0.1:9/image", &digest, None)).await.unwrap_err();
        assert_eq!(unreachable.code(), "image-fetch", "{unreachable}");
        assert!(std::fs::read_dir(dir.path().join("images")).unwrap().next().is_none());
    }
}
