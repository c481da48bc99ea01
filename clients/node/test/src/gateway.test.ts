/** The HTTP API through Gateway, on both backends; keys and TLS. */

import assert from 'node:assert/strict';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, test } from 'node:test';

import * as fencegate from 'fencegate';

import { backendArgs, BACKENDS, BINARY, defer, gatewayOn, run, startGateway } from './harness.js';

for (const backend of BACKENDS) {
  describe(`on the ${backend} backend`, () => {
    test('seed timeline: two writers, the late one refused', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());

      const first = await gateway.put('orders', 'o-1', 'from 41', { token: 41, holder: 'node-a' });
      assert.deepEqual([first.created, first.version, first.token], [true, 1, 41n]);
      const second = await gateway.put('orders', 'o-1', 'from 42', { token: 42n, holder: 'node-b' });
      assert.deepEqual([second.created, second.version], [false, 2]);

      const refused = await gateway.put('orders', 'o-1', 'late', { token: 41, holder: 'node-a' }).then(
        () => assert.fail('a stale write was accepted'),
        (error: unknown) => error,
      );
      assert.ok(refused instanceof fencegate.StaleToken);
      assert.ok(refused instanceof fencegate.FenceError);
      assert.ok(!(refused instanceof fencegate.TransientError));
      assert.deepEqual([refused.status, refused.resource, refused.presented, refused.highest], [409, 'orders', 41n, 42n]);

      const stored = await gateway.get('orders', 'o-1');
      assert.deepEqual([stored?.text(), stored?.version, stored?.token], ['from 42', 2, 42n]);
      assert.deepEqual(await gateway.fence('orders'), { resource: 'orders', highest: 42n, replayed: false });
      assert.equal(await gateway.get('orders', 'never-written'), null);
    });

    test('delete, preconditions and advance', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());

      await gateway.put('jobs', 'a/b c%d', '1', { token: 3, ifNoneMatch: true });
      await assert.rejects(gateway.put('jobs', 'a/b c%d', 'again', { token: 3, ifNoneMatch: true }), (error) => {
        assert.ok(error instanceof fencegate.VersionMismatch);
        assert.equal(error.current, 1);
        return true;
      });
      assert.equal((await gateway.put('jobs', 'a/b c%d', '2', { token: 3, ifMatch: 1 })).version, 2);
      await assert.rejects(gateway.put('jobs', 'a/b c%d', 'lost update', { token: 3, ifMatch: 1 }), fencegate.VersionMismatch);

      assert.equal((await gateway.advance('jobs', { token: 10 })).highest, 10n);
      await assert.rejects(gateway.delete('jobs', 'a/b c%d', { token: 9 }), fencegate.StaleToken);
      assert.equal((await gateway.delete('jobs', 'a/b c%d', { token: 10 })).version, 3);
      assert.equal(await gateway.get('jobs', 'a/b c%d'), null);
    });

    test('lease steps one by one', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());

      const first = await gateway.acquireLease('sweeper', { holder: 'node-a', ttlMs: 30_000 });
      assert.deepEqual([first.held, first.holder, first.token], [true, 'node-a', 1n]);
      assert.equal((await gateway.fence('sweeper')).highest, 1n, 'acquire raises the fence to the new token');
      await assert.rejects(gateway.acquireLease('sweeper', { holder: 'node-b', ttlMs: 30_000 }), (error) => {
        assert.ok(error instanceof fencegate.LeaseHeld);
        assert.equal(error.holder, 'node-a');
        assert.ok(error.expiresInMs !== undefined && error.expiresInMs > 0 && error.expiresInMs <= 30_000);
        return true;
      });
      assert.equal((await gateway.renewLease('sweeper', { holder: 'node-a', token: 1, ttlMs: 30_000 })).token, 1n);
      await assert.rejects(
        gateway.renewLease('sweeper', { holder: 'node-b', token: 1, ttlMs: 30_000 }),
        fencegate.LeaseLost,
      );
      assert.equal((await gateway.releaseLease('sweeper', { holder: 'node-a', token: 1 })).held, false);
      assert.equal((await gateway.acquireLease('sweeper', { holder: 'node-b', ttlMs: 30_000 })).token, 2n);
      assert.equal((await gateway.readLease('sweeper')).holder, 'node-b');
      assert.ok(await gateway.ready());
    });

    test('/v1/sql needs Postgres with --sql', async (t) => {
      const process = await gatewayOn(t, backend);
      const gateway = new fencegate.Gateway(process.url);
      defer(t, () => gateway.close());
      const expected = backend === 'embedded' ? fencegate.NotSupportedByBackend : fencegate.SqlDisabled;
      await assert.rejects(gateway.sql('sweeper', ['SELECT 1'], { token: 1 }), expected);
    });

    test('bearer keys and grants', async (t) => {
      const [writer, reader] = [await newKey(), await newKey()];
      const dir = mkdtempSync(join(tmpdir(), 'fencegate-auth-'));
      const { args } = await backendArgs(t, backend);
      const process = await startGateway(t, [...args, '--auth-file', authFile(dir, writer, reader)]);

      const anonymous = new fencegate.Gateway(process.url);
      defer(t, () => anonymous.close());
      await assert.rejects(anonymous.put('sweeper', 'k', 'v', { token: 1 }), (error) => {
        assert.ok(error instanceof fencegate.Unauthenticated);
        assert.equal(error.status, 401);
        return true;
      });
      const stranger = new fencegate.Gateway(process.url, { key: 'fgk_not-a-key-anyone-holds' });
      defer(t, () => stranger.close());
      await assert.rejects(stranger.get('sweeper', 'k'), fencegate.Unauthenticated);

      const gateway = new fencegate.Gateway(process.url, { key: writer.key, holder: 'node-a' });
      defer(t, () => gateway.close());
      const lease = gateway.lease('sweeper', { ttlMs: 10_000 });
      assert.ok(await lease.acquire({ wait: false }));
      assert.equal((await gateway.readLease('sweeper')).identity, 'sweeper-node-a');
      assert.equal((await lease.put('k', 'v')).version, 1);
      await assert.rejects(gateway.put('billing', 'k', 'v', { token: lease.token }), fencegate.Forbidden);
      await lease.release();

      const auditor = new fencegate.Gateway(process.url, { key: reader.key });
      defer(t, () => auditor.close());
      assert.equal((await auditor.get('sweeper', 'k'))?.text(), 'v');
      await assert.rejects(auditor.advance('sweeper', { token: 99 }), fencegate.Forbidden);
      assert.equal((await auditor.fence('sweeper')).highest, 1n, 'refused requests changed nothing');
    });
  });
}

test('TLS with a CA file and a client certificate', async (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'fencegate-tls-'));
  await makeCertificates(dir);
  const [writer, reader] = [await newKey(), await newKey()];
  const { args } = await backendArgs(t, 'embedded');
  const process = await startGateway(
    t,
    [
      ...args,
      '--auth-file', authFile(dir, writer, reader, 'node-b.sweeper.internal'),
      '--tls-cert', join(dir, 'server.crt'),
      '--tls-key', join(dir, 'server.key'),
      '--tls-client-ca', join(dir, 'ca.crt'),
    ],
    'https',
  );
  const caFile = join(dir, 'ca.crt');
  const byKey = new fencegate.Gateway(process.url, { caFile, key: writer.key });
  defer(t, () => byKey.close());
  assert.ok((await byKey.put('sweeper', 'k', 'over TLS', { token: 1 })).created);

  const byCertificate = new fencegate.Gateway(process.url, {
    caFile,
    clientCert: join(dir, 'client.crt'),
    clientKey: join(dir, 'client.key'),
  });
  defer(t, () => byCertificate.close());
  // The certificate's name is the auditor's: it may write, not advance.
  assert.equal((await byCertificate.put('sweeper', 'k', 'by certificate', { token: 1 })).version, 2);
  await assert.rejects(byCertificate.advance('sweeper', { token: 2 }), fencegate.Forbidden);

  const noCredentials = new fencegate.Gateway(process.url, { caFile });
  defer(t, () => noCredentials.close());
  await assert.rejects(noCredentials.get('sweeper', 'k'), fencegate.Unauthenticated);

  const unknownCa = new fencegate.Gateway(process.url);
  defer(t, () => unknownCa.close());
  await assert.rejects(unknownCa.get('sweeper', 'k'), (error) => {
    assert.ok(error instanceof fencegate.GatewayUnreachable);
    assert.equal(error.writeApplied, false, 'the handshake failed: nothing was sent');
    assert.match(error.message, /UNABLE_TO_VERIFY_LEAF_SIGNATURE|SELF_SIGNED|CERT/);
    return true;
  });
});

interface Key {
  key: string;
  hash: string;
}

async function newKey(): Promise<Key> {
  const { stdout } = await run(BINARY, ['key', 'new']);
  const fields = Object.fromEntries(
    stdout
      .split('\n')
      .filter((line) => line.includes(':'))
      .map((line) => [line.slice(0, line.indexOf(':')), line.slice(line.indexOf(':') + 1).trim()]),
  ) as Record<string, string>;
  return { key: fields['key']!, hash: fields['hash']! };
}

function authFile(dir: string, writer: Key, reader: Key, certificateName?: string): string {
  const path = join(dir, 'auth.toml');
  writeFileSync(
    path,
    `
[[identity]]
name = "sweeper-node-a"
keys = ["${writer.hash}"]
grants = [{ resources = ["sweeper"], actions = ["read", "write", "advance", "lease"] }]

[[identity]]
name = "auditor"
keys = ["${reader.hash}"]
${certificateName === undefined ? '' : `certificates = ["${certificateName}"]`}
grants = [{ resources = ["sweeper"], actions = ["read", "write"] }]
`,
  );
  return path;
}

/** A CA; a server certificate for 127.0.0.1; a client certificate for node-b.sweeper.internal. */
async function makeCertificates(dir: string): Promise<void> {
  const openssl = (...args: string[]): Promise<unknown> => run('openssl', args, { cwd: dir });
  const ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes'];
  await openssl('req', '-x509', ...ec, '-subj', '/CN=fencegate test CA', '-days', '2', '-keyout', 'ca.key',
    '-out', 'ca.crt', '-addext', 'basicConstraints=critical,CA:TRUE', '-addext', 'keyUsage=critical,keyCertSign');
  for (const [name, extensions] of [
    ['server', 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n'],
    ['client', 'subjectAltName=DNS:node-b.sweeper.internal\nextendedKeyUsage=clientAuth\n'],
  ] as const) {
    writeFileSync(join(dir, `${name}.ext`), extensions);
    await openssl('req', '-new', ...ec, '-subj', `/CN=${name}`, '-keyout', `${name}.key`, '-out', `${name}.csr`);
    await openssl('x509', '-req', '-days', '2', '-in', `${name}.csr`, '-CA', 'ca.crt', '-CAkey', 'ca.key',
      '-CAcreateserial', '-extfile', `${name}.ext`, '-out', `${name}.crt`);
  }
}
