-- PostgreSQL's 0007 leaves room on work_items' pages for a claim's new row version; SQLite
-- rewrites a row in place and has no such setting, so there is nothing to do here. The file
-- keeps the two backends' lists of migrations the same.
SELECT 1;
