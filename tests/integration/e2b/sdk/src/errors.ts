export * from 'e2b'
