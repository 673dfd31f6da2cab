// The e2b SDK against Warren: create, run, write/read, list, kill.
// Env: E2B_API_URL, E2B_SANDBOX_URL (the same Warren port), E2B_API_KEY;
// WARREN_E2B_TEMPLATE picks the template (default "base").
import { Sandbox, CommandExitError } from 'e2b'
import assert from 'node:assert/strict'

const template = process.env.WARREN_E2B_TEMPLATE ?? 'base'
const sbx = await Sandbox.create(template, { metadata: { suite: 'warren-smoke' }, timeoutMs: 120_000 })
try {
  const r = await sbx.commands.run('echo hello; echo oops >&2; pwd')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'hello\n/home/user\n')
  assert.equal(r.stderr, 'oops\n')
  await assert.rejects(sbx.commands.run('exit 3'), (e) => e instanceof CommandExitError && e.exitCode === 3)
  await sbx.files.write('/tmp/x/data.txt', 'payload\n')
  assert.equal(await sbx.files.read('/tmp/x/data.txt'), 'payload\n')
  const cat = await sbx.commands.run('cat /tmp/x/data.txt')
  assert.equal(cat.stdout, 'payload\n')
  const entries = await sbx.files.list('/tmp/x')
  assert.deepEqual(entries.map((e) => e.name), ['data.txt'])
  assert.equal(await sbx.files.exists('/tmp/x/nope'), false)
  const found = await Sandbox.list({ query: { metadata: { suite: 'warren-smoke' } } }).nextItems()
  assert.ok(found.some((s) => s.sandboxId === sbx.sandboxId))
  const info = await sbx.getInfo()
  assert.equal(info.templateId, template)
  console.log(JSON.stringify({ ok: true, sandboxId: sbx.sandboxId }))
} finally {
  await sbx.kill()
}
assert.equal(await Sandbox.kill(sbx.sandboxId), false)
