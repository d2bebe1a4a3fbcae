\set k random(0, 9)
WITH ins AS (INSERT INTO f (key) VALUES ('k' || :k) ON CONFLICT DO NOTHING RETURNING true AS claimed) SELECT claimed, NULL::int, NULL::bytea FROM ins UNION ALL SELECT false, status, body FROM f WHERE key = 'k' || :k AND NOT EXISTS (SELECT FROM ins);
