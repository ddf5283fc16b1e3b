"""Run-once tasks: a job that takes effect once per (task code, business key).

``_runner`` holds ``TaskRunner`` (the state machine, the lease that fences the
run, its renewal), ``_run`` the ``TaskRun`` a job is handed (its token, its
steps' writes), ``_command`` ``dedup task run`` and ``run_task``; ``_scheduler``
holds ``Scheduler`` (cron schedules fired once per period) over ``_periods``
(when a cron line fires, and which due periods run: pure).

They may import the layers below them (leases, Postgres, the basics); only the
package's face (``import dedup``) and ``cli`` import them.
"""
