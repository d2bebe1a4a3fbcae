\set k random(0, 9)
SELECT * FROM t_claim('\x'::bytea, 'k' || :k, '\x00'::bytea, 'new', 60, 86400);
