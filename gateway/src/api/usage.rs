//! `usage.*`: a tenant's usage rows (the lines of its `usage.window_closed` and
//! `usage.correction` events, read from its `usage/<tenant>` stream), summed by group on request,
//! and the prices per SKU (platform objects on the root tenant's chain, set by its
//! administrators, read by anyone who reads usage).
//!
//! A reservation held for a tenant in a pool another tenant offered lives on the owner's chain,
//! and so does the line counting it, marked with its holder: it is the holder's usage. So a
//! tenant's rows are its own stream's lines not held for another, then the lines held for it on
//! the usage streams of the tenants that offered it a pool (each row naming that
//! `ownerTenantId`, whose chain its `eventSeq` and `seqs` are on).

use std::collections::BTreeMap;

use bc_core::canonical;
use bc_core::id::TenantId;
use bc_core::store::{ExpectedVersion, decode_rows};
use bc_core::{Error, Result};
use bc_projections::usage::{
    KIND_USAGE, KIND_USAGE_PRICE, PRICE_PERIODS_MAX, USAGE_CORRECTION, USAGE_PRICE_SET, USAGE_WINDOW_CLOSED, UsageCorrection,
    UsageLine, UsagePriceDoc, UsagePriceSet, UsageWindowClosed,
};
use bc_projections::{KIND_POOL_OFFER, PoolOfferDoc, stream_of};
use schemars::JsonSchema;
use serde::Deserialize;

use super::paging::{LIST_LIMIT_MAX, limit};
use super::validate::{LimitNumber, TenantIdText};
use super::views::{UsageCostView, UsageGroupView, UsageListView, UsagePriceView, UsageRowView};
use super::{Access, Call, Method, method};

pub(super) const METHODS: &[Method] = &[
    method!(
        "usage.list",
        Access::Action("compute:usage:read"),
        "a tenant's usage rows (closed windows and corrections) in a range, or their sums by group",
        UsageList => UsageListView,
        usage_list,
    ),
    method!(
        "usage.setPrice",
        Access::Action("compute:usage:admin"),
        "set a SKU's price per unit-hour (GPU-, vCPU-, GiB- or sandbox-hour) from a time on (root tenant only)",
        UsagePricesSet => UsagePriceView,
        usage_prices_set,
    ),
    method!(
        "usage.listPrices",
        Access::Action("compute:usage:read"),
        "every SKU's price periods",
        UsagePricesList => Vec<UsagePriceView>,
        usage_prices_list,
    ),
];

/// Usage events one call reads at most: a page of rows may come back short (with its cursor)
/// when the range is sparse, and a grouped sum over more is refused.
pub const USAGE_EVENTS_READ_MAX: u32 = 20_000;
/// Pools offered to one tenant that `usage.list` reads the owners of, at most.
pub const OFFERED_POOLS_READ_MAX: usize = 10_000;
/// Usage events read per query.
const EVENTS_PER_READ: u32 = 500;
/// Longest SKU.
pub const SKU_CHARS_MAX: usize = 64;
/// Highest price per unit-hour, in millionths: a million of the currency.
pub const GPU_HOUR_MICROS_MAX: u64 = 1_000_000_000_000;
/// The latest time a usage method takes: 2^53 − 1 ms (JSON's exact integers; year 287,396).
pub const TIME_MS_MAX: u64 = 9_007_199_254_740_991;
/// Most SKUs `usage.listPrices` answers with.
pub const PRICE_SKUS_LISTED_MAX: usize = 1000;
/// Most `groupBy` keys: each of them once.
const GROUP_BY_MAX: usize = 7;

/// What `usage.list` may sum by.
#[derive(Deserialize, JsonSchema, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "camelCase")]
pub enum UsageGroupBy {
    Window,
    Pool,
    Sku,
    Reservation,
    Instance,
    Sandbox,
    /// The project of the reservation or instance a row counts (a row of none is in the group
    /// of none).
    Project,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsageList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// Rows of the windows that start at or after this time (ms since the epoch).
    #[schemars(range(min = 0, max = TIME_MS_MAX))]
    from_ms: u64,
    /// ... and before this one (at or before `fromMs`: an empty range, no rows).
    #[schemars(range(min = 0, max = TIME_MS_MAX))]
    to_ms: u64,
    /// Sum the range's rows by these keys instead of listing them (no paging); always by resource
    /// kind too.
    #[serde(default)]
    #[schemars(length(max = 7))]
    group_by: Vec<UsageGroupBy>,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    /// `nextCursor` of the page before: `VERSION_LINE`, or `VERSION_LINE_OWNER` once the rows
    /// come from the chain of a tenant that offered this one a pool.
    #[schemars(regex(pattern = r"^[1-9][0-9]{0,18}_[0-9]{1,9}(_ten_[0-7][0-9A-HJKMNP-TV-Za-hjkmnp-tv-z]{25})?$"))]
    cursor: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsagePricesSet {
    /// The GPU product (`H100-SXM5-80GB`), or `vCPU`, `Memory-GiB`, `Sandbox`: 1 to 64 of A-Z a-z
    /// 0-9 . _ -, starting with a letter or digit.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"))]
    sku: String,
    /// ISO 4217, three capital letters.
    #[schemars(regex(pattern = r"^[A-Z]{3}$"))]
    currency: String,
    /// The price of one unit-hour of the SKU (a GPU-hour; a vCPU-, GiB- or sandbox-hour), a
    /// decimal with at most 6 places (`2.5`), at most 1,000,000.
    #[schemars(regex(pattern = r"^([0-9]{1,6}(\.[0-9]{1,6})?|1000000(\.0{1,6})?)$"))]
    gpu_hour_price: String,
    /// From when it holds (until the SKU's next period), ms since the epoch; now when absent.
    #[schemars(range(min = 0, max = TIME_MS_MAX))]
    from_ms: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsagePricesList {
    /// Only this SKU's.
    #[serde(default)]
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"))]
    sku: Option<String>,
}

/// The lines of one usage event, with the event's kind, seq and time; none for another type.
fn lines_of(event: &bc_core::event::StoredEvent) -> Result<(&'static str, Vec<UsageLine>)> {
    let env = &event.envelope;
    let json = canonical::to_json(&env.payload);
    let bad = |e: serde_json::Error| Error::Internal(format!("usage event seq {}: {e}", env.seq));
    Ok(match env.event_type.as_str() {
        USAGE_WINDOW_CLOSED => ("usage", serde_json::from_value::<UsageWindowClosed>(json).map_err(bad)?.lines),
        USAGE_CORRECTION => ("correction", serde_json::from_value::<UsageCorrection>(json).map_err(bad)?.lines),
        _ => ("", Vec::new()),
    })
}

/// A cursor `VERSION_LINE`: the next row is line `LINE` of the usage event at `VERSION` of the
/// tenant's own usage stream; `VERSION_LINE_OWNER`: of the usage stream of `OWNER`, a tenant that
/// offered it a pool ([`usage_owners`]).
fn parse_cursor(cursor: Option<&str>) -> Result<(u64, u32, Option<TenantId>)> {
    let Some(text) = cursor else { return Ok((1, 0, None)) };
    let parsed = text.split_once('_').and_then(|(v, rest)| {
        let (line, owner) = match rest.split_once('_') {
            Some((line, owner)) => (line, Some(owner.parse::<TenantId>().ok()?)),
            None => (rest, None),
        };
        Some((v.parse::<u64>().ok()?, line.parse::<u32>().ok()?, owner))
    });
    match parsed {
        Some((version, line, owner)) if version >= 1 && text.len() <= 80 => Ok((version, line, owner)),
        _ => Err(Error::invalid("malformed cursor: pass the nextCursor of the page before")),
    }
}

/// The tenants whose chains may hold usage of this tenant: the owners of the pools offered to it
/// (its `pool_offer/pool_…` rows, withdrawn offers too, since their reservations ran on), each
/// once, in order. A reservation held for it lives on its pool owner's chain, and so does the
/// line counting it ([`UsageLine::holder_tenant_id`]).
async fn usage_owners(call: &Call<'_>, tenant: TenantId) -> Result<Vec<TenantId>> {
    let mut owners = std::collections::BTreeSet::new();
    let (text, mut after, mut read) = (tenant.to_string(), None::<String>, 0usize);
    loop {
        let rows = call.state.store.row_list(&text, KIND_POOL_OFFER, after.as_deref(), LIST_LIMIT_MAX).await?;
        let full = rows.len() == LIST_LIMIT_MAX as usize;
        read += rows.len();
        after = rows.last().map(|r| r.key.id.clone());
        for row in rows {
            let offer: PoolOfferDoc = super::call::doc(row)?;
            owners
                .insert(offer.owner_tenant_id.parse::<TenantId>().map_err(|e| Error::Internal(format!("pool offer row: {e}")))?);
        }
        if !full {
            return Ok(owners.into_iter().collect());
        }
        if read >= OFFERED_POOLS_READ_MAX {
            return Err(Error::Internal(format!("tenant {tenant} was offered more than {OFFERED_POOLS_READ_MAX} pools")));
        }
    }
}

async fn usage_list(call: &Call<'_>, input: UsageList) -> Result<UsageListView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    check_time("fromMs", input.from_ms)?;
    check_time("toMs", input.to_ms)?;
    if input.group_by.len() > GROUP_BY_MAX {
        return Err(Error::invalid(format!("at most {GROUP_BY_MAX} groupBy keys")));
    }
    let page_limit = if input.group_by.is_empty() { limit(input.limit)? } else { u32::MAX };
    let (cursor_version, skip_lines, cursor_owner) = parse_cursor(input.cursor.as_deref())?;
    if input.to_ms <= input.from_ms {
        // An empty range: no window starts in it.
        return Ok(UsageListView { items: Vec::new(), groups: Vec::new(), next_cursor: None });
    }
    // The tenant's own usage stream, then each owner's that offered it a pool: its lines there
    // are those held for it, its lines on its own stream those not held for another.
    let chains: Vec<TenantId> = std::iter::once(tenant).chain(usage_owners(call, tenant).await?).collect();
    let first = match cursor_owner {
        None => 0,
        Some(owner) => chains
            .iter()
            .skip(1)
            .position(|c| *c == owner)
            .map(|i| i + 1)
            // Well formed, but not one this tenant's pages can give: a pool offer from the
            // tenant it names (`… not found`, 404).
            .ok_or_else(|| Error::not_found(format!("the cursor's tenant {owner}: a pool offer from it to tenant {tenant}")))?,
    };
    let tenant_text = tenant.to_string();
    let (mut items, mut groups) = (Vec::new(), BTreeMap::new());
    let mut read = 0u32;
    let mut next_cursor = None;
    'chains: for (at, chain) in chains.iter().enumerate().skip(first) {
        let (chain_text, owner) = (chain.to_string(), (at > 0).then(|| chain.to_string()));
        let cursor_of = |version: u64, line: usize| match &owner {
            Some(owner) => format!("{version}_{line}_{owner}"),
            None => format!("{version}_{line}"),
        };
        // The cursor's lines are skipped in the event it names, on its chain, not in every later one.
        let (mut version, skip) = if at == first { (cursor_version, skip_lines) } else { (1, 0) };
        let skip_in = if at == first { cursor_version } else { 0 };
        let stream = stream_of(KIND_USAGE, &chain_text);
        loop {
            let rows = call.state.store.read_stream_rows(*chain, &stream, version - 1, EVENTS_PER_READ).await?;
            let count = rows.len() as u32;
            for event in decode_rows(rows)? {
                let env = &event.envelope;
                let (kind, lines) = lines_of(&event)?;
                let first_line = if env.version == skip_in { skip } else { 0 };
                for (i, line) in lines.into_iter().enumerate().skip(first_line as usize) {
                    if items.len() as u32 == page_limit {
                        next_cursor = Some(cursor_of(env.version, i));
                        break 'chains;
                    }
                    if line.window_start_ms < input.from_ms
                        || line.window_start_ms >= input.to_ms
                        || !line.is_usage_of(&tenant_text, &chain_text)
                    {
                        continue;
                    }
                    let mut row = UsageRowView::new(kind, env.seq, i as u32, env.at_ms, line);
                    row.owner_tenant_id = owner.clone();
                    if input.group_by.is_empty() { items.push(row) } else { add_to_group(&mut groups, &input.group_by, row) }
                }
                version = env.version + 1;
                read += 1;
                if read >= USAGE_EVENTS_READ_MAX {
                    if !input.group_by.is_empty() {
                        return Err(Error::invalid(format!(
                            "the range holds more than {USAGE_EVENTS_READ_MAX} usage events: sum a shorter range"
                        )));
                    }
                    next_cursor = Some(cursor_of(version, 0));
                    break 'chains;
                }
            }
            if count < EVENTS_PER_READ {
                break;
            }
        }
    }
    Ok(UsageListView { items, groups: groups.into_values().collect(), next_cursor })
}

/// A group's key: the resource kind (always), then the window, pool, SKU, reservation, instance,
/// sandbox and project when asked for (a row without an instance, a sandbox or a project is in
/// the group of none).
type GroupKey =
    (String, Option<u64>, Option<String>, Option<String>, Option<String>, Option<String>, Option<String>, Option<String>);

fn add_to_group(groups: &mut BTreeMap<GroupKey, UsageGroupView>, by: &[UsageGroupBy], row: UsageRowView) {
    let has = |k| by.contains(&k);
    let key: GroupKey = (
        row.resource_kind.clone(),
        has(UsageGroupBy::Window).then_some(row.window_start_ms),
        has(UsageGroupBy::Pool).then(|| row.pool_id.clone()),
        has(UsageGroupBy::Sku).then(|| row.sku.clone()),
        if has(UsageGroupBy::Reservation) { row.reservation_id.clone() } else { None },
        if has(UsageGroupBy::Instance) { row.instance_id.clone() } else { None },
        if has(UsageGroupBy::Sandbox) { row.sandbox_id.clone() } else { None },
        if has(UsageGroupBy::Project) { row.project_id.clone() } else { None },
    );
    let group = groups.entry(key.clone()).or_insert_with(|| UsageGroupView {
        resource_kind: key.0,
        window_start_ms: key.1,
        pool_id: key.2,
        sku: key.3,
        reservation_id: key.4,
        instance_id: key.5,
        sandbox_id: key.6,
        project_id: key.7,
        ..Default::default()
    });
    group.quantity_ms += row.quantity_ms;
    group.rows += 1;
    let currency = row.currency.unwrap_or_default();
    match group.costs.iter_mut().find(|c| c.currency == currency) {
        Some(cost) => cost.cost_micros += row.cost_micros,
        None => group.costs.push(UsageCostView { currency, cost_micros: row.cost_micros }),
    }
}

fn check_time(field: &str, ms: u64) -> Result<()> {
    if ms > TIME_MS_MAX {
        return Err(Error::invalid(format!("{field} {ms} is past the latest time, {TIME_MS_MAX}")));
    }
    Ok(())
}

/// `2.5` → 2,500,000 millionths.
fn parse_price_micros(text: &str) -> Result<u64> {
    let bad =
        || Error::invalid(format!("gpuHourPrice {:?} is not a decimal with at most 6 places", bc_core::id::truncate(text, 40)));
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole)
        || whole.len() > 7
        || (!fraction.is_empty() && !digits(fraction))
        || fraction.len() > 6
        || text.ends_with('.')
    {
        return Err(bad());
    }
    let whole: u64 = whole.parse().map_err(|_| bad())?;
    let fraction: u64 = format!("{fraction:0<6}").parse().map_err(|_| bad())?;
    let micros = whole * 1_000_000 + fraction;
    if micros > GPU_HOUR_MICROS_MAX {
        return Err(Error::invalid(format!("gpuHourPrice is past the most, {}", GPU_HOUR_MICROS_MAX / 1_000_000)));
    }
    Ok(micros)
}

/// Checks a SKU: 1 to [`SKU_CHARS_MAX`] of A-Z a-z 0-9 . _ -, starting with a letter or digit.
fn validate_sku(sku: &str) -> Result<()> {
    let ok = !sku.is_empty()
        && sku.len() <= SKU_CHARS_MAX
        && sku.as_bytes()[0].is_ascii_alphanumeric()
        && sku.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!("sku {:?} is not 1 to {SKU_CHARS_MAX} of A-Z a-z 0-9 . _ -", bc_core::id::truncate(sku, 80))))
    }
}

/// An operator action, as quotas are: a tenant's key must not set its own prices.
async fn usage_prices_set(call: &Call<'_>, input: UsagePricesSet) -> Result<UsagePriceView> {
    if !call.principal().is_root() {
        return Err(Error::AccessDenied("only the root tenant's administrators set prices".into()));
    }
    validate_sku(&input.sku)?;
    if input.currency.len() != 3 || !input.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(Error::invalid(format!(
            "currency {:?} is not an ISO 4217 code (USD, EUR)",
            bc_core::id::truncate(&input.currency, 20)
        )));
    }
    let micros = parse_price_micros(&input.gpu_hour_price)?;
    if let Some(from_ms) = input.from_ms {
        check_time("fromMs", from_ms)?;
    }
    let from_ms = input.from_ms.unwrap_or_else(|| call.now_ms());
    let root = TenantId::ROOT;
    let current = call.state.store.row_get(&root.to_string(), KIND_USAGE_PRICE, &input.sku).await?;
    let current = current.map(super::call::doc::<UsagePriceDoc>).transpose()?;
    let expected = match &current {
        Some(doc) if doc.periods.len() >= PRICE_PERIODS_MAX && !doc.periods.iter().any(|p| p.from_ms == from_ms) => {
            return Err(Error::state(
                format!("sku {} has {PRICE_PERIODS_MAX} price periods, the most", input.sku),
                "set a price at an existing period's start to replace it",
            ));
        }
        Some(doc) => ExpectedVersion::Exact(doc.version),
        None => ExpectedVersion::NoStream,
    };
    let payload = bc_projections::events::to_cbor(&UsagePriceSet {
        sku: input.sku.clone(),
        from_ms,
        currency: input.currency,
        gpu_hour_micros: micros,
    })?;
    call.append(root, stream_of(KIND_USAGE_PRICE, &input.sku), expected, USAGE_PRICE_SET, payload).await?;
    let doc: UsagePriceDoc = call.row(root, KIND_USAGE_PRICE, &input.sku, "price of sku").await?;
    Ok(doc.into())
}

async fn usage_prices_list(call: &Call<'_>, input: UsagePricesList) -> Result<Vec<UsagePriceView>> {
    let root = TenantId::ROOT.to_string();
    if let Some(sku) = &input.sku {
        validate_sku(sku)?;
        let row = call.state.store.row_get(&root, KIND_USAGE_PRICE, sku).await?;
        return row.map(|r| super::call::doc::<UsagePriceDoc>(r).map(Into::into)).into_iter().collect();
    }
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let rows = call.state.store.row_list(&root, KIND_USAGE_PRICE, after.as_deref(), LIST_LIMIT_MAX).await?;
        let full = rows.len() == LIST_LIMIT_MAX as usize;
        after = rows.last().map(|r| r.key.id.clone());
        for row in rows {
            out.push(super::call::doc::<UsagePriceDoc>(row)?.into());
        }
        if !full || out.len() >= PRICE_SKUS_LISTED_MAX {
            return Ok(out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prices_and_cursors_are_checked_at_the_edge() {
        assert_eq!(parse_price_micros("2.5").unwrap(), 2_500_000);
        assert_eq!(parse_price_micros("0.000001").unwrap(), 1);
        assert_eq!(parse_price_micros("12").unwrap(), 12_000_000);
        for bad in ["", ".5", "2.", "2.1234567", "-1", "1e3", "12345678", "2,5"] {
            assert!(parse_price_micros(bad).is_err(), "{bad:?}");
        }
        assert!(validate_sku("H100-SXM5-80GB").is_ok());
        for bad in ["", "-a", "a b", &"a".repeat(65)] {
            assert!(validate_sku(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_cursor(Some("12_3")).unwrap(), (12, 3, None));
        let owner: TenantId = "ten_01hzz00000000000000000000a".parse().unwrap();
        assert_eq!(parse_cursor(Some(&format!("12_3_{owner}"))).unwrap(), (12, 3, Some(owner)));
        for bad in ["", "12", "0_1", "a_1", "1_-1", "1_2_", "1_2_pool_01hzz00000000000000000000a", "1_2_ten_x"] {
            assert!(parse_cursor(Some(bad)).is_err(), "{bad:?}");
        }
    }
}
