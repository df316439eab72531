//! `images.*`: the disk images instances boot from, registered by name, URL and the SHA-256
//! the bytes must have. The control plane never fetches an image: a node will, and checks the
//! digest before it boots anything from it.
//!
//! The URL enters the log, so it may carry no secret: no user or password and no query string
//! (where presigned URLs put their signatures).
//!
//! An image is registered in the `testing` channel; `images.promote` moves it, once, to
//! `stable`. Instances and sandbox templates name an image by id, whatever its channel, or by
//! channel (`NAME@stable`, [`image_named`]), resolved when the call is decided.

use bc_core::id::{ImageId, TenantId, truncate};
use bc_core::store::ExpectedVersion;
use bc_core::{Error, Result};
use bc_projections::events as ev;
use bc_projections::{ImageDoc, KIND_IMAGE, stream_of};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::{check_if_version, doc, expected_version};
use super::paging::{Page, list_input};
use super::resource::list_where;
use super::validate::{ImageIdText, NameText, TenantIdText, VersionNumber, string_schema, validate_name};
use super::views::{DiskFormatView, ImageChannelView, ImageDeletedView, ImageView};
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:images:read");
const WRITE: Access = Access::Action("compute:images:write");

/// Longest image URL, in bytes (ASCII only, so also in characters).
pub const IMAGE_URL_BYTES_MAX: usize = 2048;
/// Longest host name in a URL (DNS's bound).
pub const IMAGE_URL_HOST_CHARS_MAX: usize = 253;
/// Largest image size stated, in bytes: 64 TiB, a flavor's largest disk.
pub const IMAGE_SIZE_BYTES_MAX: u64 = 64 << 40;
/// Images one tenant registers at most: a register reads them all (name uniqueness).
pub const IMAGES_PER_TENANT_MAX: u32 = 500;
/// Characters of a SHA-256 in hex.
pub const SHA256_HEX_CHARS: usize = 64;
const _: () = assert!(IMAGES_PER_TENANT_MAX <= bc_core::store::READ_ROWS_MAX);
const _: () = assert!(IMAGE_SIZE_BYTES_MAX == super::flavors::FLAVOR_DISK_GIB_MAX << 30);

pub(super) const METHODS: &[Method] = &[
    method!("images.register", WRITE, "register a disk image by URL and SHA-256", ImagesRegister => ImageView, images_register),
    method!("images.get", READ, "one image", ImageRef => ImageView, images_get),
    method!("images.list", READ, "a tenant's images, paged by cursor", ImagesList => Page<ImageView>, images_list),
    method!("images.delete", WRITE, "delete an image", ImageRef => ImageDeletedView, images_delete),
    method!("images.promote", WRITE, "promote an image from the testing channel to stable", ImageRef => ImageView, images_promote),
];

/// A TCP port, 1 to 65535, without leading zeros.
const PORT_PATTERN: &str = "(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})";
/// What a path may hold: unreserved characters, `/`, `+` and percent escapes' characters.
const PATH_CHARS: &str = "A-Za-z0-9._~/%+-";

/// The image URL's pattern, exactly what [`validate_image_url`] takes.
fn image_url_pattern() -> String {
    format!("^https?://[A-Za-z0-9][A-Za-z0-9.-]{{0,{}}}(:{PORT_PATTERN})?(/[{PATH_CHARS}]*)?$", IMAGE_URL_HOST_CHARS_MAX - 1)
}

string_schema!(
    /// An image URL ([`validate_image_url`]): `https://` or `http://`, a host, an optional port
    /// and path; no user, password, query or fragment.
    ImageUrl as "ImageUrl",
    |_| {
        schemars::json_schema!({
            "type": "string",
            "maxLength": IMAGE_URL_BYTES_MAX,
            "pattern": image_url_pattern(),
        })
    }
);

string_schema!(
    /// A SHA-256 in lowercase hex ([`validate_sha256`]).
    Sha256Hex as "Sha256Hex",
    |_| schemars::json_schema!({ "type": "string", "pattern": format!("^[0-9a-f]{{{SHA256_HEX_CHARS}}}$") })
);

/// Refuses a URL the schema's pattern refuses, saying why.
pub fn validate_image_url(url: &str) -> Result<()> {
    // A URL with a user part may hold a password: it is never echoed back, even shortened.
    let shown =
        if url.contains('@') { "(not shown: it may hold a password)".to_owned() } else { format!("{:?}", truncate(url, 70)) };
    let refuse = |why: &str| Error::InvalidArgument {
        message: format!("url {shown} {why}"),
        hint: Some("give https://HOST[:PORT]/PATH (or http://), without user, password or query".into()),
    };
    if url.len() > IMAGE_URL_BYTES_MAX {
        return Err(Error::invalid(format!("url is longer than {IMAGE_URL_BYTES_MAX} bytes")));
    }
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or_else(|| refuse("is not https:// or http://"))?;
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    if authority.contains('@') {
        return Err(refuse("carries a user or password, which would enter the log"));
    }
    let (host, port) = match authority.split_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (authority, None),
    };
    let host_ok = host.len() <= IMAGE_URL_HOST_CHARS_MAX
        && host.starts_with(|c: char| c.is_ascii_alphanumeric())
        && host.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-');
    if !host_ok {
        return Err(refuse("has no valid host name"));
    }
    if let Some(port) = port {
        let port_ok = (1..=5).contains(&port.len())
            && !port.starts_with('0')
            && port.bytes().all(|b| b.is_ascii_digit())
            && port.parse::<u32>().is_ok_and(|p| p <= 65_535);
        if !port_ok {
            return Err(refuse("has a port outside 1 to 65535"));
        }
    }
    if path.contains(['?', '#']) {
        return Err(refuse("has a query or fragment, which would enter the log"));
    }
    if !path.chars().all(|c| c.is_ascii_alphanumeric() || "._~/%+-".contains(c)) {
        return Err(refuse("has characters a path may not hold (percent-encode them)"));
    }
    Ok(())
}

/// A SHA-256 in lowercase hex.
pub fn validate_sha256(text: &str) -> Result<()> {
    if text.len() != SHA256_HEX_CHARS || !text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(Error::InvalidArgument {
            message: format!("sha256 {:?} is not {SHA256_HEX_CHARS} lowercase hex digits", truncate(text, 70)),
            hint: Some("give the digest as `sha256sum` prints it".into()),
        });
    }
    Ok(())
}

string_schema!(
    /// An image by channel: `NAME@stable` or `NAME@testing`, the newest image of that name in
    /// that channel when the call is decided (`bc_projections::decide::image`).
    ImageChannelRefText as "ImageChannelRef",
    |_| schemars::json_schema!({
        "type": "string",
        "pattern": "^[a-z0-9][a-z0-9._-]{0,62}@(stable|testing)$",
    })
);

/// The image a call names: by id (`imageId`) or by channel (`image`, `NAME@stable`), exactly
/// one of them. A channel is resolved now, over the tenant's images, and what the call appends
/// carries the image it resolved to.
pub(super) async fn image_named(
    call: &Call<'_>,
    tenant: TenantId,
    image_id: Option<&str>,
    image: Option<&str>,
) -> Result<ImageDoc> {
    match (image_id, image) {
        (Some(id), None) => {
            let id: ImageId = parse_id("imageId", id)?;
            call.row(tenant, KIND_IMAGE, &id.to_string(), "image").await
        }
        (None, Some(reference)) => {
            let reference = bc_projections::decide::image::parse_channel_ref(reference)?;
            let rows = call.state.store.row_list(&tenant.to_string(), KIND_IMAGE, None, IMAGES_PER_TENANT_MAX).await?;
            let images = rows.into_iter().map(super::call::doc::<ImageDoc>).collect::<Result<Vec<_>>>()?;
            bc_projections::decide::image::resolve_channel(&images, &reference).cloned()
        }
        _ => Err(Error::invalid("name the image by exactly one of imageId (img_…) and image (NAME@stable, NAME@testing)")),
    }
}

/// Whether an image called `name` may be registered beside the tenant's images.
pub fn check_image_fits(existing: &[ImageDoc], name: &str) -> Result<()> {
    if let Some(same) = existing.iter().find(|i| i.name == name) {
        return Err(Error::AlreadyExists { what: format!("image {name:?} ({})", same.image_id) });
    }
    if existing.len() >= IMAGES_PER_TENANT_MAX as usize {
        return Err(Error::state(
            format!("a tenant has at most {IMAGES_PER_TENANT_MAX} images"),
            "delete images no flavor or instance uses (images delete)",
        ));
    }
    Ok(())
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImagesRegister {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// Unique within the tenant.
    #[schemars(with = "NameText")]
    name: String,
    #[schemars(with = "ImageUrl")]
    url: String,
    #[schemars(with = "Sha256Hex")]
    sha256: String,
    disk_format: DiskFormatView,
    /// The image's size in bytes, when known.
    #[schemars(range(min = 1, max = IMAGE_SIZE_BYTES_MAX))]
    size_bytes: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "ImageIdText")]
    image_id: String,
    /// Act only while the image is at this version.
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

list_input!(ImagesList {
    /// Only the images in this channel.
    channel: Option<ImageChannelView>,
});

/// What promoting `image` appends: `testing` → `stable`; a stable image has nowhere to go.
pub fn image_promotion(image: &ImageDoc) -> Result<ev::ImagePromoted> {
    match image.channel {
        ev::ImageChannel::Testing => Ok(ev::ImagePromoted { from: ev::ImageChannel::Testing, to: ev::ImageChannel::Stable }),
        ev::ImageChannel::Stable => Err(Error::state(
            format!("image {} ({:?}) is already stable", image.image_id, image.name),
            "stable is the last channel: register new bytes as a new image to test them",
        )),
    }
}

async fn image_doc(call: &Call<'_>, tenant: TenantId, id: &ImageId) -> Result<ImageDoc> {
    call.row(tenant, KIND_IMAGE, &id.to_string(), "image").await
}

async fn images_register(call: &Call<'_>, input: ImagesRegister) -> Result<ImageView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_name("name", &input.name)?;
    validate_image_url(&input.url)?;
    validate_sha256(&input.sha256)?;
    if let Some(size) = input.size_bytes
        && !(1..=IMAGE_SIZE_BYTES_MAX).contains(&size)
    {
        return Err(Error::invalid(format!("sizeBytes must be 1 to {IMAGE_SIZE_BYTES_MAX} (64 TiB), not {size}")));
    }
    // A retry is answered from the log (the append replays it): its own image holds the name.
    // The names' lock is held until the append is done, so in this process one registration
    // of a name passes the check at a time; two gateway processes registering one name at once
    // can both pass it, and the images are then told apart by id.
    let _names = call.state.name_locks.lock(tenant).await;
    if !call.is_retry(tenant).await? {
        let rows = call.state.store.row_list(&tenant.to_string(), KIND_IMAGE, None, IMAGES_PER_TENANT_MAX).await?;
        let existing = rows.into_iter().map(doc::<ImageDoc>).collect::<Result<Vec<_>>>()?;
        check_image_fits(&existing, &input.name)?;
    }
    let image = ImageId::from_ulid(call.ulid());
    let payload = ev::to_cbor(&ev::ImageRegistered {
        name: input.name,
        url: input.url,
        sha256: input.sha256,
        disk_format: input.disk_format.into(),
        size_bytes: input.size_bytes,
    })?;
    let result =
        call.append(tenant, stream_of(KIND_IMAGE, &image), ExpectedVersion::NoStream, ev::IMAGE_REGISTERED, payload).await?;
    Ok(call.created::<ImageDoc>(tenant, &result).await?.into())
}

async fn images_get(call: &Call<'_>, input: ImageRef) -> Result<ImageView> {
    Ok(call.named::<ImageDoc>(&input.tenant_id, &input.image_id).await?.into())
}

async fn images_list(call: &Call<'_>, input: ImagesList) -> Result<Page<ImageView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let channel = input.channel.map(ev::ImageChannel::from);
    list_where(call, tenant, input.limit, input.cursor.as_deref(), |i: &ImageDoc| channel.is_none_or(|c| i.channel == c)).await
}

async fn images_promote(call: &Call<'_>, input: ImageRef) -> Result<ImageView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: ImageId = parse_id("imageId", &input.image_id)?;
    check_if_version(input.if_version)?;
    let current = image_doc(call, tenant, &id).await?;
    let stream = stream_of(KIND_IMAGE, &id);
    // A retry is answered from the log (the append replays it), though the image it promoted
    // is stable now.
    let promotion = if call.is_retry(tenant).await? {
        ev::ImagePromoted { from: ev::ImageChannel::Testing, to: ev::ImageChannel::Stable }
    } else {
        let expected = expected_version(input.if_version, current.version, &stream)?;
        let promotion = image_promotion(&current)?;
        call.append(tenant, stream, expected, ev::IMAGE_PROMOTED, ev::to_cbor(&promotion)?).await?;
        return Ok(image_doc(call, tenant, &id).await?.into());
    };
    call.append(tenant, stream, ExpectedVersion::Exact(current.version), ev::IMAGE_PROMOTED, ev::to_cbor(&promotion)?).await?;
    Ok(image_doc(call, tenant, &id).await?.into())
}

async fn images_delete(call: &Call<'_>, input: ImageRef) -> Result<ImageDeletedView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: ImageId = parse_id("imageId", &input.image_id)?;
    let current = image_doc(call, tenant, &id).await?;
    let stream = stream_of(KIND_IMAGE, &id);
    let expected = expected_version(input.if_version, current.version, &stream)?;
    call.append(tenant, stream, expected, ev::IMAGE_DELETED, ev::to_cbor(&ev::ImageDeleted {})?).await?;
    Ok(ImageDeletedView { image_id: id.to_string(), deleted: true })
}

#[cfg(test)]
mod tests {
    use schemars::{JsonSchema, SchemaGenerator};

    use super::*;

    /// The schema's pattern and the validator agree, checked with a real regex engine.
    #[test]
    fn the_url_pattern_says_what_the_validator_does() {
        let pattern = regex::Regex::new(&image_url_pattern()).unwrap();
        let long_host = format!("https://{}/x", "a".repeat(IMAGE_URL_HOST_CHARS_MAX));
        let too_long_host = format!("https://{}/x", "a".repeat(IMAGE_URL_HOST_CHARS_MAX + 1));
        let cases = [
            ("https://images.example.com/ubuntu-24.04.qcow2", true),
            ("http://10.0.0.5:8080/img/raw.img", true),
            ("https://a", true),
            ("https://a/", true),
            ("https://a:65535/x", true),
            ("https://a:1/x%20y+z~", true),
            (long_host.as_str(), true),
            (too_long_host.as_str(), false),
            ("ftp://a/x", false),
            ("file:///etc/passwd", false),
            ("https://", false),
            ("https://-a/x", false),
            ("https://user:pw@a/x", false),
            ("https://a/x?sig=secret", false),
            ("https://a/x#frag", false),
            ("https://a:0/x", false),
            ("https://a:65536/x", false),
            ("https://a:080/x", false),
            ("https://a:/x", false),
            ("https://a/x y", false),
            ("https://a/é", false),
            ("https://a/x@y", false),
            ("HTTPS://a/x", false),
            ("https://[::1]/x", false),
        ];
        for (url, ok) in cases {
            assert_eq!(pattern.is_match(url), ok, "pattern, {url:?}");
            assert_eq!(validate_image_url(url).is_ok(), ok, "validator, {url:?}");
        }
        let refusal = validate_image_url("https://user:hunter2@a/x").unwrap_err().to_string();
        assert!(!refusal.contains("hunter2"), "a password is never echoed: {refusal}");
        let too_long = format!("https://a/{}", "x".repeat(IMAGE_URL_BYTES_MAX));
        assert!(validate_image_url(&too_long).is_err());
        let schema = ImageUrl::json_schema(&mut SchemaGenerator::default());
        assert_eq!(schema.get("maxLength").and_then(|v| v.as_u64()), Some(IMAGE_URL_BYTES_MAX as u64));
    }

    #[test]
    fn a_digest_is_64_lowercase_hex_digits() {
        let pattern = Sha256Hex::json_schema(&mut SchemaGenerator::default());
        let pattern = regex::Regex::new(pattern.get("pattern").unwrap().as_str().unwrap()).unwrap();
        let good = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        for (text, ok) in [
            (good.to_owned(), true),
            (good.to_uppercase(), false),
            (good[..63].to_owned(), false),
            (format!("{good}0"), false),
            (good.replace('e', "g"), false),
            (String::new(), false),
        ] {
            assert_eq!(pattern.is_match(&text), ok, "pattern, {text:?}");
            assert_eq!(validate_sha256(&text).is_ok(), ok, "validator, {text:?}");
        }
    }

    fn image(name: &str, n: usize) -> ImageDoc {
        ImageDoc {
            tenant_id: "ten_x".into(),
            image_id: format!("img_{n}"),
            name: name.into(),
            url: "https://a/x".into(),
            sha256: "0".repeat(64),
            disk_format: ev::DiskFormat::Qcow2,
            size_bytes: None,
            channel: ev::ImageChannel::Testing,
            version: 1,
            created_at_ms: 0,
        }
    }

    #[test]
    fn an_image_is_promoted_once_from_testing_to_stable() {
        let mut testing = image("ubuntu", 0);
        let promoted = image_promotion(&testing).unwrap();
        assert_eq!((promoted.from, promoted.to), (ev::ImageChannel::Testing, ev::ImageChannel::Stable));
        testing.channel = ev::ImageChannel::Stable;
        let err = image_promotion(&testing).unwrap_err();
        assert_eq!(err.code(), bc_core::ErrorCode::InvalidState);
        assert!(err.to_string().contains("already stable"), "{err}");
    }

    #[test]
    fn names_are_unique_and_images_bounded_per_tenant() {
        let existing = vec![image("ubuntu", 0)];
        assert_eq!(check_image_fits(&existing, "ubuntu").unwrap_err().code(), bc_core::ErrorCode::AlreadyExists);
        assert!(check_image_fits(&existing, "debian").is_ok());
        let full: Vec<ImageDoc> = (0..IMAGES_PER_TENANT_MAX as usize).map(|n| image(&format!("i{n}"), n)).collect();
        assert_eq!(check_image_fits(&full, "one-more").unwrap_err().code(), bc_core::ErrorCode::InvalidState);
    }
}
