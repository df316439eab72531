-- Node leases: a node's session renews its lease with every heartbeat (an UPDATE, never an
-- append); the liveness reconciler compares each lease with what it last reported and appends
-- node.ready or node.unreachable when they differ. Operational state, not the log: losing a
-- row makes the node unreachable until its next heartbeat. Safe to apply twice.
CREATE TABLE IF NOT EXISTS node_leases (
    tenant_id          TEXT    NOT NULL,
    node_id            TEXT    NOT NULL,
    expires_at_ms      INTEGER NOT NULL,
    -- 1 when the log last said ready, 0 when unreachable (or never said).
    reported_reachable INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, node_id)
);
