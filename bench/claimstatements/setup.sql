CREATE TABLE t (scope bytea NOT NULL, key text NOT NULL, fingerprint bytea NOT NULL, token text NOT NULL, expires_at timestamptz NOT NULL, response bytea, sweep_at timestamptz NOT NULL DEFAULT 'infinity', PRIMARY KEY (scope, key)) WITH (fillfactor = 80);
CREATE INDEX t_sweep_at ON t (sweep_at);
INSERT INTO t SELECT '\x'::bytea, 'k' || g, decode(repeat('ab',32),'hex'), 'tok' || g, now() + interval '1 day', decode(repeat('cd',100),'hex'), now() + interval '2 days' FROM generate_series(0,9) g;
CREATE TABLE f (key text PRIMARY KEY, status int, body bytea);
INSERT INTO f SELECT 'k' || g, 201, decode(repeat('cd',45),'hex') FROM generate_series(0,9) g;
CREATE FUNCTION t_claim(p_scope bytea, p_key text, p_fp bytea, p_token text, p_lease float8, p_sweep float8)
RETURNS TABLE (fingerprint bytea, token text, left_s float8, response bytea) LANGUAGE plpgsql AS $$
BEGIN
  RETURN QUERY SELECT r.fingerprint, r.token, extract(epoch FROM r.expires_at - now())::float8, r.response FROM t r WHERE r.scope = p_scope AND r.key = p_key;
  IF FOUND THEN RETURN; END IF;
  INSERT INTO t (scope, key, fingerprint, token, expires_at, sweep_at) VALUES (p_scope, p_key, p_fp, p_token, now() + p_lease * interval '1 second', now() + p_sweep * interval '1 second') ON CONFLICT DO NOTHING;
  IF FOUND THEN RETURN QUERY SELECT NULL::bytea, NULL::text, NULL::float8, NULL::bytea; RETURN; END IF;
  RETURN QUERY SELECT r.fingerprint, r.token, extract(epoch FROM r.expires_at - now())::float8, r.response FROM t r WHERE r.scope = p_scope AND r.key = p_key;
END $$;
