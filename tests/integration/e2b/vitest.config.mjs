// The E2B SDK's own command and filesystem tests (sdk/tests), run against Warren.
import { defineConfig } from 'vitest/config'

export default defineConfig({
  test: {
    include: ['sdk/tests/sandbox/**/*.test.ts'],
    testTimeout: 60_000,
    hookTimeout: 60_000,
    fileParallelism: false,
    maxConcurrency: 1,
  },
})
