"""AWS list prices the idle-cost table uses: us-east-1, on-demand, no free tier, no discounts.

Taken on ``TAKEN_ON`` from the pricing page each constant names (stored copies of those
pages, read that day; prices change, so re-read them and update the date before quoting
the table). ``python -m infra.idle_cost`` turns them into the table in docs/deploy.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date

TAKEN_ON = date(2026, 12, 7)
REGION = "us-east-1"
HOURS_PER_MONTH = 730
"""AWS's own month in its pricing examples (and the calculator's): 730 hours."""
MINUTES_PER_MONTH = HOURS_PER_MONTH * 60
SECONDS_PER_MONTH = HOURS_PER_MONTH * 3600


@dataclass(frozen=True)
class Price:
    """One list price: dollars per ``unit``, as ``page`` states it."""

    usd: float
    unit: str
    page: str


EC2_PAGE = "https://aws.amazon.com/ec2/pricing/on-demand/"
EBS_PAGE = "https://aws.amazon.com/ebs/pricing/"
VPC_PAGE = "https://aws.amazon.com/vpc/pricing/"
ELB_PAGE = "https://aws.amazon.com/elasticloadbalancing/pricing/"
KMS_PAGE = "https://aws.amazon.com/kms/pricing/"
SECRETS_PAGE = "https://aws.amazon.com/secrets-manager/pricing/"
ROUTE53_PAGE = "https://aws.amazon.com/route53/pricing/"
CLOUDWATCH_PAGE = "https://aws.amazon.com/cloudwatch/pricing/"
LAMBDA_PAGE = "https://aws.amazon.com/lambda/pricing/"
SQS_PAGE = "https://aws.amazon.com/sqs/pricing/"
S3_PAGE = "https://aws.amazon.com/s3/pricing/"
DYNAMODB_PAGE = "https://aws.amazon.com/dynamodb/pricing/on-demand/"
ECR_PAGE = "https://aws.amazon.com/ecr/pricing/"

# --- compute and network -----------------------------------------------------------------
EC2_ON_DEMAND_HOUR = {
    "g5.xlarge": Price(1.006, "instance-hour (Linux)", EC2_PAGE),
}
"""Per instance type; the GPU stack's ``InstanceType`` default must be listed."""
GP3_GB_MONTH = Price(0.08, "GB-month (gp3 storage)", EBS_PAGE)
NAT_GATEWAY_HOUR = Price(0.045, "NAT gateway-hour", VPC_PAGE)
PUBLIC_IPV4_HOUR = Price(0.005, "public IPv4 address-hour (in use or idle)", VPC_PAGE)
ALB_HOUR = Price(0.0225, "Application Load Balancer-hour", ELB_PAGE)

# --- keys, secrets, DNS -------------------------------------------------------------------
KMS_KEY_MONTH = Price(1.00, "customer managed key-month", KMS_PAGE)
SECRET_MONTH = Price(0.40, "secret-month", SECRETS_PAGE)
HOSTED_ZONE_MONTH = Price(0.50, "hosted zone-month (first 25)", ROUTE53_PAGE)

# --- CloudWatch ---------------------------------------------------------------------------
METRIC_MONTH = Price(0.30, "custom metric-month (first 10,000; prorated by the hour)",
                     CLOUDWATCH_PAGE)  # fmt: skip
DETAILED_MONITORING_METRICS = 7
"""EC2 detailed monitoring is charged as this many custom metrics per instance."""
DASHBOARD_MONTH = Price(3.00, "dashboard-month", CLOUDWATCH_PAGE)
ALARM_METRIC_MONTH = Price(0.10, "standard-resolution alarm metric-month", CLOUDWATCH_PAGE)
METRICS_INSIGHTS_ALARM_METRIC_MONTH = Price(
    0.10, "metric analysed by a Metrics Insights query alarm, per month", CLOUDWATCH_PAGE
)
COMPOSITE_ALARM_MONTH = Price(0.50, "composite alarm-month", CLOUDWATCH_PAGE)
LOGS_INGESTED_GB = Price(0.50, "GB of logs ingested (standard class)", CLOUDWATCH_PAGE)
LOGS_STORED_GB_MONTH = Price(0.03, "GB-month of logs stored", CLOUDWATCH_PAGE)

# --- requests -----------------------------------------------------------------------------
LAMBDA_MILLION_REQUESTS = Price(0.20, "million requests", LAMBDA_PAGE)
LAMBDA_GB_SECOND = Price(0.0000166667, "GB-second (x86)", LAMBDA_PAGE)
LAMBDA_PROVISIONED_GB_SECOND = Price(0.0000041667, "GB-second provisioned (x86)", LAMBDA_PAGE)
SQS_MILLION_REQUESTS = Price(0.40, "million requests (standard queue)", SQS_PAGE)
S3_THOUSAND_LISTS = Price(0.005, "1,000 LIST requests (S3 Standard)", S3_PAGE)
DYNAMODB_MILLION_READ_UNITS = Price(0.125, "million read request units (on-demand)",
                                    DYNAMODB_PAGE)  # fmt: skip

# --- storage at rest ----------------------------------------------------------------------
S3_GB_MONTH = Price(0.023, "GB-month (S3 Standard, first 50 TB)", S3_PAGE)
DYNAMODB_GB_MONTH = Price(0.25, "GB-month (Standard table class)", DYNAMODB_PAGE)
ECR_GB_MONTH = Price(0.10, "GB-month of image storage", ECR_PAGE)
