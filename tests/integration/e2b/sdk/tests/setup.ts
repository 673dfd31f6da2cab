// Warren's stand-in for the E2B SDK's tests/setup.ts: the same fixtures
// (sandboxTest, isDebug, wait), a sandbox per test from the 'base' template
// on the Warren daemon named by E2B_API_URL / E2B_SANDBOX_URL.
import { test as base } from 'vitest'
import { Sandbox } from 'e2b'

export const template = 'base'
export const isDebug = process.env.E2B_DEBUG !== undefined

export const sandboxTest = base.extend<{
  sandbox: Sandbox
  sandboxTestId: string
  sandboxOpts: Record<string, unknown>
}>({
  sandboxTestId: [
    async ({}, use) => use(`test-${Math.random().toString(36).slice(2, 10)}`),
    { auto: true },
  ],
  sandboxOpts: {},
  sandbox: async ({ sandboxTestId, sandboxOpts }, use) => {
    const sandbox = await Sandbox.create(template, { metadata: { sandboxTestId }, ...sandboxOpts })
    try {
      await use(sandbox)
    } finally {
      await sandbox.kill().catch(() => undefined)
    }
  },
})

export async function wait(ms: number) {
  return new Promise((resolve) => setTimeout(resolve, ms))
}
