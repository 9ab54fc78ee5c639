"""AWS access, in one place: the only package of the project that imports boto3 or
botocore (a test keeps it so).

``clients`` (the one client factory, each caller's timeouts and retries as arguments),
``errors`` (botocore's exception types, imported on first use, and what callers read from
them), ``objects`` (S3 reads every store shares), ``dynamo`` (DynamoDB's typed-value
codecs) and ``limits`` (the table of AWS limits the product relies on). boto3 is imported
inside the functions that need it, so a process that never talks to AWS never imports it.
"""
