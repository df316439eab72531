-- A tenant's events by outbox position: what a watcher's poll and an `events.list` page read
-- (`WHERE tenant_id = ? AND (commit_no, commit_index) > (?, ?) ORDER BY commit_no,
-- commit_index`). Without it the read searched the tenant's whole chain and sorted it, so every
-- idle watcher's poll cost more as the log grew. Safe to apply twice.
CREATE INDEX IF NOT EXISTS events_by_tenant_position ON events (tenant_id, commit_no, commit_index);
