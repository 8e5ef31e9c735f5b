"""Code written for E2B's SDKs, unchanged, against this operator's sandboxes.

    export E2B_API_URL=http://<gateway>:3000 E2B_SANDBOX_URL=http://<gateway>:3000
    export E2B_API_KEY=$(kubectl create token sandbox-demo --duration=24h)
    python examples/e2b/hello_e2b.py

(`make up` prints the first line with the gateway's address.) The key is a
Kubernetes token, or an `e2b_` key from `kubectl sandbox e2b-key create`; the
sandbox is a Sandbox in the key's namespace (`kubectl get sandboxes`), made
from a warm member of the `e2b-code-interpreter` pool when one is ready.
Nothing below knows it is not talking to E2B (docs/e2b.md).
"""

from e2b_code_interpreter import Sandbox

with Sandbox.create(timeout=300) as sandbox:  # the code-interpreter-v1 template
    sandbox.run_code("x = 1")
    print(sandbox.run_code("x += 1; x").text)  # 2: the kernel keeps its state

    chart = sandbox.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 4, 8])\nplt.show()")
    print("a chart, as PNG:", len(chart.results[0].png or ""), "bytes of base64")

    sandbox.files.write("/home/user/hello.txt", "hello from E2B's SDK")
    print(sandbox.commands.run("cat hello.txt; echo; whoami; pwd").stdout)
    print("sandbox", sandbox.sandbox_id, "is running:", sandbox.is_running())
# Leaving the block kills the sandbox (its Sandbox resource is deleted).
