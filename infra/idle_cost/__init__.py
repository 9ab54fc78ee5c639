"""What each deploy shape costs a month while idle, computed from the templates.

    python -m infra.idle_cost           # rewrite the table in docs/deploy.md
    python -m infra.idle_cost --check   # exit 1 when docs/deploy.md differs

Idle: no requests, no jobs, no provisioned concurrency, every template at its default
parameters (the GPU stack's ``MinTasks`` as the shape says). Each stack is deployed
offline with ``infra.checks.cfn_eval`` (conditions and parameters resolved as
CloudFormation would: ``deployment``) and every resource that costs money at idle becomes
a line (``model``): one unit's monthly cost (``infra.prices``) times the units the shape
runs. Every resource type the templates use is priced by a line (``Line.types``) or says
in ``FREE_AT_IDLE`` why it costs nothing at idle; ``tests/unit/test_aws_terms_templates.py``
fails on one that does neither. ``report`` renders the lines as the table in
docs/deploy.md.
"""
