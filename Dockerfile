# The operator image, for users with a registry:
#   docker build -t REGISTRY/sandbox-operator:TAG .
# The chart runs it as `kopf run -m sandbox_operator.main ...` (see templates/deployment.yaml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY operator ./operator
# The SDK with its MCP server (`sandbox-mcp`, the chart's optional mcp Deployment).
COPY sandbox-sdk ./sandbox-sdk
RUN pip install . './sandbox-sdk[mcp]' && rm -rf /root/.cache

# Non-root, and nothing to write: the chart mounts the root filesystem read-only.
USER 65532:65532
ENTRYPOINT ["kopf"]
CMD ["run", "-m", "sandbox_operator.main", "--standalone", "--all-namespaces", "--log-format=json"]
