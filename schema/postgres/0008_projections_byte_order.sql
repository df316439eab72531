-- Projection rows' keys compare byte by byte, as SQLite's do (issue 17). A list method's page
-- is `WHERE tenant_id = $1 AND kind = $2 AND id COLLATE "C" > $3 ORDER BY id COLLATE "C"`, so
-- that its cursor and order are the same on both backends; under the database's own collation
-- (C.UTF-8 or a language's) the primary key's index is in another order and cannot give that
-- one, so each page read every row of its kind and sorted them (8 ms for a page of 100 nodes
-- out of 20,000; a full listing, or a fleet view's load, quadratic in the rows). With the
-- columns in the "C" collation the index is in the pages' order. Rebuilds the table's indexes
-- once. Safe to apply twice.
ALTER TABLE projections
    ALTER COLUMN tenant_id TYPE TEXT COLLATE "C",
    ALTER COLUMN kind TYPE TEXT COLLATE "C",
    ALTER COLUMN id TYPE TEXT COLLATE "C";
