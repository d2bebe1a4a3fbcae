\set k random(0, 9)
SELECT fingerprint, token, extract(epoch FROM expires_at - now())::float8, response FROM t WHERE scope = '\x'::bytea AND key = 'k' || :k;
