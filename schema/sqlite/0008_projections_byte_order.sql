-- PostgreSQL's 0008 puts the projection rows' keys in the "C" collation, so its primary key
-- orders them as a list method's page does. SQLite compares text byte by byte already (BINARY),
-- so there is nothing to do here. The file keeps the two backends' lists of migrations the same.
SELECT 1;
