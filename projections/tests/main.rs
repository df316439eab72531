//! `bc-projections`'s integration tests, one binary: each file is a module, named in nextest's
//! output as `integration FILE::test` (run one file with `cargo nextest run -p bc-projections -E 'test(/^FILE::/)'`).

mod support;

mod decide;
mod events_catalogue;
mod fleet_locks;
mod offers;
mod placement_property;
mod rollout;
mod volume_disk_race;
