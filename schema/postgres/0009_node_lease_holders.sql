-- Which session holds each node's lease: a node's session claims its lease when it binds,
-- naming itself (the gateway process and the session), and a gateway closes its own session
-- of a node whose lease another session has claimed since (two gateways behind a load balancer:
-- an agent that reconnected through the other one, while this one's stream is still open).
-- claimed_at_ms is when the last claim was written, so a gateway reads only the recent claims.
ALTER TABLE node_leases ADD COLUMN IF NOT EXISTS holder TEXT NOT NULL DEFAULT '';
ALTER TABLE node_leases ADD COLUMN IF NOT EXISTS claimed_at_ms BIGINT NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS node_leases_by_claim ON node_leases (claimed_at_ms);
