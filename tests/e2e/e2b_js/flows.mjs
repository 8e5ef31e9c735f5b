// The founding flow, written for E2B's JavaScript SDKs as their users write
// it, against this operator through the E2B adapter. Run by
// tests/e2e/test_e2b_js_e2e.py with node, from a directory where
// package.json's packages are installed.
//
// Environment: E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (read by the SDK
// itself), E2B_TEMPLATE (the template to create from; default
// code-interpreter-v1). Prints one JSON object on its last line: what each
// step saw, for the test to check.
import { Sandbox } from '@e2b/code-interpreter';

const template = process.env.E2B_TEMPLATE || 'code-interpreter-v1';
const seen = {};

const started = Date.now();
const sandbox = await Sandbox.create(template, { timeoutMs: 300_000 });
seen.created = { sandboxId: sandbox.sandboxId, ms: Date.now() - started };
try {
  // State kept across runs.
  const first = await sandbox.runCode('x = 1');
  const second = await sandbox.runCode('x + 1');
  seen.runCode = {
    first: { results: first.results.length, error: first.error ?? null },
    second: { text: second.text, executionCount: second.executionCount },
    executionCounts: [first.executionCount, second.executionCount],
  };

  // A chart as PNG, reported to onResult as it comes.
  const streamed = [];
  const chart = await sandbox.runCode(
    'import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title("squares")\nplt.show()',
    { onResult: (result) => streamed.push(result.formats()) },
  );
  seen.chart = {
    results: chart.results.map((r) => ({
      formats: r.formats(),
      isMainResult: r.isMainResult,
      pngHead: r.png ? Buffer.from(r.png, 'base64').subarray(0, 8).toString('hex') : null,
    })),
    streamed,
    error: chart.error ?? null,
  };

  // An exception is the execution's error, not a throw.
  const failed = await sandbox.runCode('1 / 0');
  seen.error = failed.error ? { name: failed.error.name, value: failed.error.value } : null;

  // A command with streaming callbacks.
  const stdout = [];
  const stderr = [];
  const command = await sandbox.commands.run('echo hello; echo oops >&2; echo done', {
    onStdout: (data) => stdout.push(data),
    onStderr: (data) => stderr.push(data),
  });
  seen.command = {
    exitCode: command.exitCode,
    stdout: command.stdout,
    stderr: command.stderr,
    streamedStdout: stdout.join(''),
    streamedStderr: stderr.join(''),
  };

  // Files written and read back, and seen by the code.
  await sandbox.files.write('/home/user/flows.txt', 'written by flows.mjs\n');
  seen.files = {
    read: await sandbox.files.read('/home/user/flows.txt'),
    fromCode: (
      await sandbox.runCode("print(open('/home/user/flows.txt').read(), end='')")
    ).logs.stdout.join(''),
  };
} finally {
  await sandbox.kill();
  seen.killed = true;
}
seen.runningAfterKill = await sandbox.isRunning();

console.log(JSON.stringify(seen));
