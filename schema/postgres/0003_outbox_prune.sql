-- Pruning finds a consumer's done items by age without scanning the rest. Safe to apply twice.
CREATE INDEX IF NOT EXISTS work_items_done ON work_items (consumer, updated_at_ms) WHERE state = 'done';
