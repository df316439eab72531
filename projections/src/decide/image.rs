//! Images named by channel (`NAME@stable`, `NAME@testing`): which registered image such a
//! reference names now. Pure: the gateway reads the tenant's images and appends the resolved id
//! (an instance's `instance.created` and a sandbox template's `sandbox_template.created` carry
//! the image itself), so a replay of the log never resolves a reference again.

use bc_core::{Error, Result};

use crate::ImageDoc;
use crate::image::ImageChannel;

/// An image reference by channel: the image's name and the channel it must be in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelRef {
    pub name: String,
    pub channel: ImageChannel,
}

/// `NAME@stable` or `NAME@testing` (NAME as an image's name: 1 to 63 of a-z 0-9 - . _, starting
/// with a letter or digit), else `INVALID_ARGUMENT`.
pub fn parse_channel_ref(text: &str) -> Result<ChannelRef> {
    let refuse = || Error::InvalidArgument {
        message: format!("{:?} is not an image by channel", bc_core::id::truncate(text, 80)),
        hint: Some("name an image by id (img_…) or as NAME@stable or NAME@testing".into()),
    };
    let (name, channel) = text.rsplit_once('@').ok_or_else(refuse)?;
    let channel = match channel {
        "stable" => ImageChannel::Stable,
        "testing" => ImageChannel::Testing,
        _ => return Err(refuse()),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.' | '_'));
    if !name_ok {
        return Err(refuse());
    }
    Ok(ChannelRef { name: name.to_owned(), channel })
}

/// The image `reference` names among the tenant's `images`: the newest (by registration, then
/// id) called `reference.name` whose channel is `reference.channel`. An image of that name in
/// the other channel (one still in `testing` for `@stable`) is `NOT_FOUND`, saying so.
pub fn resolve_channel<'a>(images: &'a [ImageDoc], reference: &ChannelRef) -> Result<&'a ImageDoc> {
    let named = || images.iter().filter(|i| i.name == reference.name);
    if let Some(image) = named()
        .filter(|i| i.channel == reference.channel)
        .max_by(|a, b| (a.created_at_ms, &a.image_id).cmp(&(b.created_at_ms, &b.image_id)))
    {
        return Ok(image);
    }
    let wanted = format!("{}@{}", reference.name, reference.channel.as_str());
    match named().next() {
        Some(other) => Err(Error::not_found(format!(
            "image {wanted} ({} is in {}: promote it, images promote {}, or name it by id)",
            other.image_id,
            other.channel.as_str(),
            other.image_id
        ))),
        None => Err(Error::not_found(format!("image {wanted}"))),
    }
}

#[cfg(test)]
mod tests {
    use bc_core::ErrorCode;

    use super::*;

    fn image(id: &str, name: &str, channel: ImageChannel, created_at_ms: u64) -> ImageDoc {
        ImageDoc {
            tenant_id: "ten_1".into(),
            image_id: id.into(),
            name: name.into(),
            url: "https://images.example.com/x".into(),
            sha256: "0".repeat(64),
            disk_format: crate::events::DiskFormat::Qcow2,
            size_bytes: None,
            channel,
            version: 1,
            created_at_ms,
        }
    }

    #[test]
    fn a_channel_reference_parses_or_is_refused() {
        assert_eq!(
            parse_channel_ref("ubuntu-24.04@stable").unwrap(),
            ChannelRef { name: "ubuntu-24.04".into(), channel: ImageChannel::Stable }
        );
        assert_eq!(parse_channel_ref("u@testing").unwrap().channel, ImageChannel::Testing);
        for bad in
            ["ubuntu", "ubuntu@", "@stable", "ubuntu@beta", "Ubuntu@stable", "a@b@stable", &format!("{}@stable", "a".repeat(64))]
        {
            assert_eq!(parse_channel_ref(bad).unwrap_err().code(), ErrorCode::InvalidArgument, "{bad}");
        }
    }

    #[test]
    fn a_channel_names_the_newest_image_of_that_name_in_it() {
        let images = [
            image("img_1", "ubuntu", ImageChannel::Stable, 10),
            image("img_2", "ubuntu", ImageChannel::Stable, 20),
            image("img_3", "ubuntu", ImageChannel::Testing, 30),
            image("img_4", "debian", ImageChannel::Testing, 5),
        ];
        let at = |text: &str| resolve_channel(&images, &parse_channel_ref(text).unwrap()).map(|i| i.image_id.clone());
        assert_eq!(at("ubuntu@stable").unwrap(), "img_2");
        assert_eq!(at("ubuntu@testing").unwrap(), "img_3");
        let err = at("debian@stable").unwrap_err();
        assert_eq!(err.code(), ErrorCode::NotFound);
        assert!(err.to_string().contains("img_4 is in testing"), "{err}");
        assert_eq!(at("alpine@stable").unwrap_err().code(), ErrorCode::NotFound);
    }
}
