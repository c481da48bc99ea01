/**
 * Sends requests with `node:http` and `node:https`.
 *
 * Not `fetch`: Node's `fetch` cannot take a CA file or a client certificate without the
 * `undici` package, and these modules can, with keep-alive agents and no dependency.
 * They also tell whether a request left before a failure, which is what decides if a
 * write is in doubt (`writeApplied: null`) or certainly not applied (`false`).
 *
 * @module
 */

import { readFileSync } from 'node:fs';
import * as http from 'node:http';
import * as https from 'node:https';
import { TLSSocket } from 'node:tls';

import { GatewayUnreachable } from './errors.js';
import type { Answer, Request } from './protocol.js';

/** TLS settings: PEM file paths. */
export interface TlsFiles {
  /** The CA that signed the gateway's certificate (default: Node's roots). */
  caFile?: string | undefined;
  /** A client certificate, for a gateway with `--tls-client-ca`. */
  clientCert?: string | undefined;
  /** The key of `clientCert`. */
  clientKey?: string | undefined;
}

/** Sends requests to one gateway over keep-alive connections. */
export class Transport {
  readonly #base: URL;
  readonly #agent: http.Agent;
  readonly #headers: Readonly<Record<string, string>>;
  readonly #timeoutMs: number;

  constructor(url: string, headers: Record<string, string>, timeoutMs: number, tls: TlsFiles) {
    this.#base = new URL(url);
    if (this.#base.protocol !== 'http:' && this.#base.protocol !== 'https:') {
      throw new TypeError(`a gateway URL is http:// or https://, not ${url}`);
    }
    this.#headers = headers;
    this.#timeoutMs = timeoutMs;
    this.#agent =
      this.#base.protocol === 'https:'
        ? new https.Agent({
            keepAlive: true,
            ...(tls.caFile === undefined ? {} : { ca: readFileSync(tls.caFile) }),
            ...(tls.clientCert === undefined ? {} : { cert: readFileSync(tls.clientCert) }),
            ...(tls.clientKey === undefined ? {} : { key: readFileSync(tls.clientKey) }),
          })
        : new http.Agent({ keepAlive: true });
  }

  /** The gateway's base URL. */
  get url(): string {
    return this.#base.href.replace(/\/$/, '');
  }

  /** Closes idle connections. */
  close(): void {
    this.#agent.destroy();
  }

  /**
   * Sends a request and reads the whole answer; rejects with {@link GatewayUnreachable}
   * when there is none.
   *
   * @param timeoutMs - Longest wait for the whole answer (default: the gateway's).
   */
  send(request: Request, timeoutMs?: number, signal?: AbortSignal): Promise<Answer> {
    const base = this.#base;
    const module = base.protocol === 'https:' ? https : http;
    const prefix = base.pathname.replace(/\/$/, '');
    return new Promise<Answer>((resolve, reject) => {
      // Whether the request may have reached the gateway: its connection was open.
      let reached = false;
      const fail = (error: Error): void => {
        clearTimeout(timer);
        if (signal?.aborted) {
          reject(signal.reason); // the caller's own decision, not the gateway's state
          return;
        }
        const detail = (error as NodeJS.ErrnoException).code ?? error.message;
        reject(
          new GatewayUnreachable(`no answer from the gateway at ${this.url}: ${detail}`, {
            cause: error,
            writeApplied: reached ? null : false,
          }),
        );
      };
      const outgoing = module.request(
        {
          protocol: base.protocol,
          hostname: base.hostname,
          port: base.port,
          path: prefix + request.path,
          method: request.method,
          headers: {
            ...this.#headers,
            ...request.headers,
            'content-length': String(request.body?.byteLength ?? 0),
          },
          agent: this.#agent,
          ...(signal === undefined ? {} : { signal }),
        },
        (incoming) => {
          const chunks: Buffer[] = [];
          incoming.on('data', (chunk: Buffer) => chunks.push(chunk));
          incoming.on('error', fail);
          incoming.on('end', () => {
            clearTimeout(timer);
            resolve({ status: incoming.statusCode ?? 0, headers: incoming.headers, body: Buffer.concat(chunks) });
          });
        },
      );
      const timer = setTimeout(
        () => outgoing.destroy(new Error(`timed out after ${timeoutMs ?? this.#timeoutMs} ms`)),
        timeoutMs ?? this.#timeoutMs,
      );
      timer.unref(); // the request's socket keeps the process alive, not this timer
      outgoing.on('socket', (socket) => {
        if (!socket.connecting) {
          reached = true; // a kept-alive connection
          return;
        }
        socket.once(socket instanceof TLSSocket ? 'secureConnect' : 'connect', () => {
          reached = true;
        });
      });
      outgoing.on('error', fail);
      outgoing.end(request.body === undefined ? undefined : Buffer.from(request.body));
    });
  }
}
