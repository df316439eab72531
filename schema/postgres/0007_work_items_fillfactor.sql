-- Room on each page of work_items for a claim's new row version (issue 17). A claim changes only
-- columns no index covers (the lease, the attempt counts), so PostgreSQL can write the new
-- version beside the old one on the same page without touching an index (a heap-only tuple):
-- with full pages it could not, and every claim wrote an entry in each of the table's indexes.
-- Pages written from now on keep half their room; existing ones are left as they are. Safe to
-- apply twice.
ALTER TABLE work_items SET (fillfactor = 50);
