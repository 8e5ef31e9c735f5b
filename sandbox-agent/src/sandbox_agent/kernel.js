#!/usr/bin/env node
// Code-context bridge for JavaScript: the same line protocol as kernel.py
// (read that file's docstring), with a Node.js process as the kernel.
//
// The agent starts this file through the runner, in the sandbox container,
// with the image's own `node`. It forks itself as the kernel (`--kernel`):
// cells run there with vm.Script.runInThisContext, so top-level `let`,
// `const`, `var`, functions and classes stay for the next cell, as in
// Node's REPL. A cell that uses top-level `await` runs as an async function
// (its declarations stay local to it); a promise a cell ends with is awaited.
//
// The kernel's stdout and stderr are pipes read here, never this process's
// stdout (the protocol channel), so console.log and child processes that
// inherit them are output of the run. Before each message (a result, an
// error, finished) the kernel writes a marker to both pipes, and the message
// goes out once both markers came through: output and results keep their
// order, and no output is reported after the run it belongs to.
//
// Interrupts: SIGINT to the kernel, once it said it began the run; a cell
// runs with breakOnSigint (a busy loop throws), and an awaited promise is
// abandoned. Node >= 12, no packages.
'use strict';

const fs = require('fs');

// NULs around a random token: text that programs do not print.
function markerOf(token) {
  return '\u0000' + token + '\u0000';
}

function emit(obj) {
  fs.writeSync(1, JSON.stringify(obj) + '\n');
}

if (process.argv[2] === '--kernel') {
  kernel();
} else {
  bridge();
}

function bridge() {
  const crypto = require('crypto');
  const { fork } = require('child_process');
  const { StringDecoder } = require('string_decoder');
  const readline = require('readline');

  const token = crypto.randomBytes(8).toString('hex');
  const marker = markerOf(token);
  const child = fork(__filename, ['--kernel'], {
    stdio: ['ignore', 'pipe', 'pipe', 'ipc'],
    env: Object.assign({}, process.env, { SANDBOX_KERNEL_MARKER: token }),
  });
  let current = null; // {id, began, interrupt}
  const pending = { stdout: '', stderr: '' };
  // Markers seen on each pipe, and the kernel's messages waiting for theirs:
  // message n goes out once both pipes passed marker n, after the output
  // written before it.
  const seen = { stdout: 0, stderr: 0 };
  const queued = [];

  function release() {
    while (queued.length && seen.stdout >= queued[0].seq && seen.stderr >= queued[0].seq) {
      const m = queued.shift();
      delete m.seq;
      if (m.type === 'finished') current = null;
      emit(m);
    }
  }

  for (const name of ['stdout', 'stderr']) {
    const decoder = new StringDecoder('utf8');
    child[name].on('data', (chunk) => {
      let text = pending[name] + decoder.write(chunk);
      for (;;) {
        const at = text.indexOf(marker);
        if (at < 0) break;
        if (at > 0 && current) emit({ id: current.id, type: name, text: text.slice(0, at) });
        seen[name] += 1;
        text = text.slice(at + marker.length);
        release();
      }
      // Hold back what could be the start of a marker split across reads.
      let keep = 0;
      for (let n = Math.min(marker.length - 1, text.length); n > 0; n--) {
        if (marker.startsWith(text.slice(text.length - n))) {
          keep = n;
          break;
        }
      }
      const out = text.slice(0, text.length - keep);
      pending[name] = text.slice(text.length - keep);
      if (out && current) emit({ id: current.id, type: name, text: out });
    });
  }

  child.on('message', (m) => {
    if (!m || typeof m !== 'object') return;
    if (m.type === 'ready') {
      emit({ type: 'ready', language: 'javascript', languageVersion: m.languageVersion });
    } else if (current && m.id === current.id) {
      if (m.type === 'began') {
        current.began = true;
        if (current.interrupt) child.kill('SIGINT');
      } else if (typeof m.seq === 'number') {
        queued.push(m);
        release();
      }
    }
  });

  child.on('exit', (code, signal) => {
    const how = signal ? `was killed by signal ${signal} (out of memory?)` : `ended (exit status ${code})`;
    // First: the agent ends the run with the reason.
    emit({ type: 'died', message: `the kernel ${how}` });
    if (current) {
      emit({ id: current.id, type: 'finished', status: 'error', executionCount: null });
    }
    process.exit(4);
  });

  const input = readline.createInterface({ input: process.stdin });
  input.on('line', (line) => {
    let op;
    try {
      op = JSON.parse(line);
    } catch (e) {
      return;
    }
    if (!op || typeof op !== 'object') return;
    if (op.op === 'execute' && typeof op.code === 'string') {
      if (current !== null) {
        // One run at a time (the agent never sends two): refused, not lost.
        emit({ id: String(op.id), type: 'finished', status: 'aborted', executionCount: null });
        return;
      }
      current = { id: String(op.id), began: false, interrupt: false };
      child.send({ op: 'execute', id: current.id, code: op.code, env: op.env });
    } else if (op.op === 'interrupt' && current && current.id === op.id) {
      current.interrupt = true;
      if (current.began) child.kill('SIGINT');
    }
  });
  input.on('close', () => {
    child.kill('SIGKILL');
    process.exit(0);
  });
}

function kernel() {
  const vm = require('vm');
  const util = require('util');
  const Module = require('module');

  const marker = markerOf(process.env.SANDBOX_KERNEL_MARKER || '');
  delete process.env.SANDBOX_KERNEL_MARKER;
  // What a script in Node's REPL has at hand.
  globalThis.require = Module.createRequire(process.cwd() + '/');
  let count = 0;
  let seq = 0;
  let abandon = null;
  // A message to the bridge, after a marker on both pipes: it is told only
  // once the output written before it was (pipes are written synchronously
  // on Linux, so that output is in them before the marker).
  function tell(message) {
    seq += 1;
    process.stdout.write(marker);
    process.stderr.write(marker);
    message.seq = seq;
    process.send(message);
  }
  // Outside a cell's synchronous part, an interrupt abandons what it awaits.
  process.on('SIGINT', () => {
    if (abandon) abandon();
  });
  // A callback that throws after its cell ended is reported, not fatal: the
  // kernel's state is worth more than the callback.
  process.on('uncaughtException', (err) => console.error(String((err && err.stack) || err)));
  process.on('unhandledRejection', (err) => console.error(String((err && err.stack) || err)));

  // A stack without the frames of this file and of vm that ran the cell.
  function ownFrames(stack) {
    const lines = stack.split('\n');
    const end = lines.findIndex((l) => l.includes(__filename) || /\(node:vm:|at node:vm:|sigintHandlersWrap/.test(l));
    return end < 0 ? lines : lines.slice(0, end);
  }

  function compile(code, n) {
    const filename = `cell[${n}]`;
    try {
      return new vm.Script(code, { filename });
    } catch (err) {
      if (err instanceof SyntaxError && /\bawait\b/.test(code)) {
        return new vm.Script(`(async () => {\n${code}\n})()`, { filename, lineOffset: -1 });
      }
      throw err;
    }
  }

  // A run's variables (op env) are in process.env while it runs; the values
  // they had before come back when it ends.
  function setEnv(env) {
    const saved = {};
    if (!env || typeof env !== 'object') return saved;
    for (const [k, v] of Object.entries(env)) {
      if (typeof v !== 'string') continue;
      saved[k] = Object.prototype.hasOwnProperty.call(process.env, k) ? process.env[k] : undefined;
      process.env[k] = v;
    }
    return saved;
  }

  function restoreEnv(saved) {
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  }

  async function execute(m) {
    count += 1;
    const n = count;
    process.send({ type: 'began', id: m.id });
    let status = 'ok';
    const saved = setEnv(m.env);
    try {
      let value = compile(m.code, n).runInThisContext({ breakOnSigint: true, displayErrors: false });
      if (value !== null && typeof value === 'object' && typeof value.then === 'function') {
        value = await Promise.race([
          value,
          new Promise((resolve, reject) => {
            abandon = () => reject(Object.assign(new Error('Script execution interrupted.'), { name: 'Interrupted' }));
          }),
        ]);
      }
      if (value !== undefined) {
        tell({
          id: m.id,
          type: 'result',
          data: { 'text/plain': util.inspect(value, { depth: 4 }) },
          metadata: {},
          isMain: true,
          executionCount: n,
        });
      }
    } catch (err) {
      status = 'error';
      const isError = err instanceof Error;
      tell({
        id: m.id,
        type: 'error',
        name: isError ? err.name : 'Error',
        value: isError ? err.message : util.inspect(err),
        traceback: isError && err.stack ? ownFrames(String(err.stack)) : [],
      });
    } finally {
      abandon = null;
      restoreEnv(saved);
    }
    tell({ id: m.id, type: 'finished', status, executionCount: n });
  }

  process.on('message', (m) => {
    if (m && m.op === 'execute') execute(m);
  });
  process.on('disconnect', () => process.exit(0));
  process.send({ type: 'ready', languageVersion: process.versions.node });
}
