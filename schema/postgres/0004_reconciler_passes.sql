-- The last pass of each reconciler in each process that runs it (omicron's background-task
-- status): what an operator reads with `better-compute reconcilers status`. Operational state,
-- not the log; one row per (reconciler, process), replaced by every pass and pruned when the
-- process has not passed for a week. Safe to apply twice.
CREATE TABLE IF NOT EXISTS reconciler_passes (
    name          TEXT    NOT NULL,
    instance      TEXT    NOT NULL,
    started_at_ms BIGINT NOT NULL,
    duration_ms   BIGINT NOT NULL,
    ok            BIGINT NOT NULL,
    counts        TEXT    NOT NULL,
    error         TEXT,
    passes        BIGINT NOT NULL,
    PRIMARY KEY (name, instance)
);
