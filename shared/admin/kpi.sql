-- agentbus KPIs in plain SQL. Runs unchanged in both clients:
--   sqlite3 ops_multiagent.db < scripts/kpi.sql
--   psql "$DATABASE" -f scripts/kpi.sql
-- The views are created by `busctl migrate`; each base view has an `at`
-- column (epoch seconds) for any other time window, e.g.
--   SELECT COUNT(*) FROM kpi_resumes WHERE at >= (SELECT epoch FROM bus_now) - 3600;

-- The four KPIs: value is a percent (KPI 4: a count); NULL when nothing was measured.
SELECT kpi, name,
       CASE WHEN kpi = 4 THEN numerator
            WHEN denominator = 0 THEN NULL
            ELSE ROUND(CAST(100.0 * numerator / denominator AS NUMERIC), 1) END AS value,
       target, numerator, denominator, meaning
  FROM kpi_summary
 ORDER BY kpi;

-- Quick checks: tasks paused right now ...
SELECT COUNT(*) AS paused_tasks FROM bus_commands WHERE status = 'paused';

-- ... and the cooldowns in force (cooldown_until > now), with the time left.
SELECT model_id, cooldown_until, ROUND(CAST(seconds_left AS NUMERIC), 1) AS seconds_left, reason
  FROM active_cooldowns
 ORDER BY cooldown_until;

-- Paused tasks due next.
SELECT id, agent, pause_model, resume_after, reentry_count
  FROM bus_commands
 WHERE status = 'paused'
 ORDER BY resume_after
 LIMIT 10;
