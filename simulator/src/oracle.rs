//! A reference model of the log's GPUs and reservations, apart from the fold:
//! "the projections equal a fold of the log" compares `Projections` with itself, so it
//! catches a write path that parts from a replay, never a fold that is wrong both ways. This
//! model is written from `schema/EVENTS.md` alone, never from `bc_projections`' fold: the GPUs
//! each node holds and for whom, and each reservation's state, driven by the log's events in
//! order. The full checks ([`crate::run::full_check`]) feed it every event they read and hold
//! the projection rows the per-step checker reads (`node` allocations, `reservation_live`) to
//! it; the holds property test runs the same check at its end.
//!
//! What it takes from `schema/EVENTS.md`:
//! - `node.joined`, `node.registered`: a node, holding nothing; `node.deleted`: gone.
//! - `node.allocated` (`reservationId`, `gpus`): those GPUs are the reservation's; one already
//!   held is a broken log.
//! - `node.freed` (`reservationId`): that reservation's GPUs on the node are free.
//! - `reservation.requested`, `reservation.requeued`: queued; `reservation.activated`: active;
//!   `reservation.released`, `.expired`, `.cancelled`, `.failed`: over (not live).

use std::collections::BTreeMap;

use bc_core::event::StoredEvent;
use bc_core::id::TenantId;
use serde_json::Value;

/// A reservation's state as the model has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Live {
    Queued,
    Active,
    /// Released, expired, cancelled or failed: no longer live.
    Over,
}

impl Live {
    /// The state's name in a reservation's document (`state`).
    pub fn as_str(self) -> &'static str {
        match self {
            Live::Queued => "queued",
            Live::Active => "active",
            Live::Over => "over",
        }
    }
}

/// One tenant's model.
#[derive(Clone, Debug, Default)]
pub struct TenantModel {
    /// Node id → GPU index → the reservation holding it.
    pub nodes: BTreeMap<String, BTreeMap<u32, String>>,
    /// Reservation id → its state.
    pub reservations: BTreeMap<String, Live>,
}

/// Every tenant's model, and the first thing in the log the model could not take.
#[derive(Clone, Debug, Default)]
pub struct Oracle {
    pub tenants: BTreeMap<TenantId, TenantModel>,
    pub broken: Option<String>,
}

fn id_of(stream: &str) -> &str {
    stream.split_once('/').map_or(stream, |(_, id)| id)
}

impl Oracle {
    /// Takes one event of the log (in log order).
    pub fn apply(&mut self, event: &StoredEvent) {
        let env = &event.envelope;
        let kind = env.event_type.as_str();
        let interesting = kind.starts_with("reservation.")
            || matches!(kind, "node.joined" | "node.registered" | "node.deleted" | "node.allocated" | "node.freed");
        if !interesting {
            return;
        }
        let payload = bc_core::canonical::to_json(&env.payload);
        let model = self.tenants.entry(env.tenant).or_default();
        let id = id_of(&env.stream).to_owned();
        let reservation_of = |p: &Value| p.get("reservationId").and_then(Value::as_str).unwrap_or_default().to_owned();
        match kind {
            "node.joined" | "node.registered" => {
                model.nodes.entry(id).or_default();
            }
            "node.deleted" => {
                if let Some(held) = model.nodes.remove(&id)
                    && let Some((gpu, rsv)) = held.iter().next()
                {
                    self.broken.get_or_insert(format!(
                        "seq {} of {}: {id} was deleted while GPU {gpu} was still {rsv}'s",
                        env.seq, env.tenant
                    ));
                }
            }
            "node.allocated" => {
                let rsv = reservation_of(&payload);
                let gpus: Vec<u32> = payload
                    .get("gpus")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_u64).map(|g| g as u32).collect())
                    .unwrap_or_default();
                let held = model.nodes.entry(id.clone()).or_default();
                for gpu in gpus {
                    if let Some(other) = held.insert(gpu, rsv.clone()) {
                        self.broken.get_or_insert(format!(
                            "seq {} of {}: GPU {gpu} of {id} was given to {rsv} while {other} held it",
                            env.seq, env.tenant
                        ));
                    }
                }
            }
            "node.freed" => {
                let rsv = reservation_of(&payload);
                if let Some(held) = model.nodes.get_mut(&id) {
                    held.retain(|_, holder| *holder != rsv);
                }
            }
            "reservation.requested" | "reservation.requeued" => {
                model.reservations.insert(id, Live::Queued);
            }
            "reservation.activated" => {
                model.reservations.insert(id, Live::Active);
            }
            "reservation.released" | "reservation.expired" | "reservation.cancelled" | "reservation.failed" => {
                model.reservations.insert(id, Live::Over);
            }
            // Extensions, instances attached or detached: nothing the model keeps.
            _ => {}
        }
    }

    /// The model against one tenant's rows: `nodes` (node id → allocations, from its `node`
    /// rows) and `live` (reservation id → state, from its `reservation_live` rows). `Err` names
    /// the first difference.
    pub fn compare(
        &self,
        tenant: TenantId,
        nodes: &BTreeMap<String, BTreeMap<u32, String>>,
        live: &BTreeMap<String, String>,
    ) -> Result<(), String> {
        if let Some(broken) = &self.broken {
            return Err(format!("the log itself breaks the oracle's model: {broken}"));
        }
        let empty = TenantModel::default();
        let model = self.tenants.get(&tenant).unwrap_or(&empty);
        for (node, held) in &model.nodes {
            let Some(rows) = nodes.get(node) else {
                return Err(format!("{node} of {tenant} is in the log (not deleted) but has no row"));
            };
            for gpu in held.keys().chain(rows.keys()) {
                if held.get(gpu) != rows.get(gpu) {
                    return Err(format!(
                        "GPU {gpu} of {node}: the log gives it to {:?}, its row to {:?}",
                        held.get(gpu),
                        rows.get(gpu)
                    ));
                }
            }
        }
        if let Some(node) = nodes.keys().find(|n| !model.nodes.contains_key(*n)) {
            return Err(format!("{node} of {tenant} has a row, but the log never made it or deleted it"));
        }
        let model_live = model.reservations.iter().filter(|(_, s)| **s != Live::Over);
        for (rsv, state) in model_live {
            match live.get(rsv) {
                Some(row) if row == state.as_str() => {}
                row => return Err(format!("{rsv} of {tenant}: the log says {}, its live row {row:?}", state.as_str())),
            }
        }
        for (rsv, row) in live {
            let state = model.reservations.get(rsv).copied();
            if state.is_none_or(|s| s == Live::Over) {
                return Err(format!(
                    "{rsv} of {tenant} has a live row ({row}), but the log says {}",
                    state.map_or("nothing of it", |s| s.as_str())
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The model on hand-made events, and its comparison finding each kind of difference.
    use bc_core::event::{Envelope, Position, StoredEvent};
    use ciborium::Value as Cbor;

    use super::*;

    fn event(seq: u64, stream: &str, event_type: &str, payload: serde_json::Value) -> StoredEvent {
        StoredEvent {
            envelope: Envelope {
                tenant: TenantId::ROOT,
                seq,
                id: format!("evt_01jd00000000000000000000{seq:02}").parse().expect("an event id"),
                stream: stream.into(),
                version: 1,
                event_type: event_type.into(),
                at_ms: 1,
                actor: "test".into(),
                idempotency_key: None,
                causation: None,
                correlation: None,
                payload: bc_core::canonical::from_json(&payload).unwrap_or(Cbor::Null),
                prev: [0; 32],
            },
            canonical: vec![],
            hash: [0; 32],
            sig: vec![],
            key_id: String::new(),
            position: Position { commit: seq, index: 0 },
        }
    }

    fn rows(pairs: &[(u32, &str)]) -> BTreeMap<String, BTreeMap<u32, String>> {
        let held = pairs.iter().map(|(g, r)| (*g, (*r).to_owned())).collect();
        BTreeMap::from([("node_a".to_owned(), held)])
    }

    fn live(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(r, s)| ((*r).to_owned(), (*s).to_owned())).collect()
    }

    fn oracle() -> Oracle {
        let mut o = Oracle::default();
        let events = [
            event(1, "node/node_a", "node.joined", serde_json::json!({})),
            event(2, "reservation/rsv_1", "reservation.requested", serde_json::json!({"gpus": 2})),
            event(3, "reservation/rsv_2", "reservation.requested", serde_json::json!({"gpus": 1})),
            event(4, "reservation/rsv_1", "reservation.activated", serde_json::json!({"nodeId": "node_a", "gpus": [0, 1]})),
            event(5, "node/node_a", "node.allocated", serde_json::json!({"reservationId": "rsv_1", "gpus": [0, 1]})),
            event(6, "reservation/rsv_2", "reservation.activated", serde_json::json!({"nodeId": "node_a", "gpus": [2]})),
            event(7, "node/node_a", "node.allocated", serde_json::json!({"reservationId": "rsv_2", "gpus": [2]})),
            event(8, "reservation/rsv_1", "reservation.released", serde_json::json!({})),
            event(9, "node/node_a", "node.freed", serde_json::json!({"reservationId": "rsv_1"})),
        ];
        for e in &events {
            o.apply(e);
        }
        o
    }

    #[test]
    fn the_model_follows_the_log_and_agrees_with_right_rows() {
        let o = oracle();
        assert_eq!(o.compare(TenantId::ROOT, &rows(&[(2, "rsv_2")]), &live(&[("rsv_2", "active")])), Ok(()));
    }

    #[test]
    fn a_freed_gpu_still_held_a_lost_allocation_or_a_wrong_state_is_named() {
        let o = oracle();
        let all_live = live(&[("rsv_2", "active")]);
        let kept = o.compare(TenantId::ROOT, &rows(&[(0, "rsv_1"), (1, "rsv_1"), (2, "rsv_2")]), &all_live).unwrap_err();
        assert!(kept.contains("GPU 0 of node_a: the log gives it to None, its row to Some(\"rsv_1\")"), "{kept}");
        let lost = o.compare(TenantId::ROOT, &rows(&[]), &all_live).unwrap_err();
        assert!(lost.contains("GPU 2 of node_a: the log gives it to Some(\"rsv_2\")"), "{lost}");
        let state = o.compare(TenantId::ROOT, &rows(&[(2, "rsv_2")]), &live(&[("rsv_2", "queued")])).unwrap_err();
        assert!(state.contains("rsv_2") && state.contains("the log says active"), "{state}");
        let over = o.compare(TenantId::ROOT, &rows(&[(2, "rsv_2")]), &live(&[("rsv_2", "active"), ("rsv_1", "active")]));
        assert!(over.unwrap_err().contains("rsv_1 of"), "a released reservation with a live row");
    }

    #[test]
    fn a_gpu_given_twice_in_the_log_breaks_the_model() {
        let mut o = oracle();
        o.apply(&event(10, "node/node_a", "node.allocated", serde_json::json!({"reservationId": "rsv_3", "gpus": [2]})));
        let e = o.compare(TenantId::ROOT, &rows(&[(2, "rsv_3")]), &live(&[])).unwrap_err();
        assert!(e.contains("GPU 2 of node_a was given to rsv_3 while rsv_2 held it"), "{e}");
    }
}
