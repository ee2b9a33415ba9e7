// A stand-in for Prisma's native query-engine binary (5.17.0), for prisma-client-py, built only from
// npm packages: @prisma/query-engine-wasm (same engine commit) + @prisma/adapter-pg + pg.
//
// prisma-client-py spawns `query-engine -p PORT ...` with PRISMA_DML_PATH set, and talks to it over
// HTTP using the GraphQL protocol. The Wasm engine only speaks Prisma's JSON protocol, so this
// translates the (small, regular) GraphQL that prisma-client-py's query builder emits into JSON
// protocol requests, and the typed JSON-protocol results back into GraphQL-protocol shapes.
//
// For benchmarks/gateway_overhead.py only (LiteLLM's proxy with its Postgres spend tracking, where
// Prisma's engine binaries cannot be downloaded): overhead_services.py copies this file next to its
// node_modules and points PRISMA_QUERY_ENGINE_BINARY at a wrapper that runs it. Not covered:
// /metrics (answers empty), interactive-transaction isolation levels beyond the engine's defaults.
import fs from 'node:fs';
import http from 'node:http';
import pg from 'pg';
import { PrismaPg } from '@prisma/adapter-pg';
import { bindAdapter } from '@prisma/driver-adapter-utils';
import * as wasm from '@prisma/query-engine-wasm/postgresql/query_engine.js';

const argv = process.argv.slice(2);
const port = Number(argv[argv.indexOf('-p') + 1] || argv[argv.indexOf('--port') + 1]);
const datamodel = fs.readFileSync(process.env.PRISMA_DML_PATH, 'utf8');
let url = process.env.DATABASE_URL;
if (process.env.OVERWRITE_DATASOURCES) {
  for (const ds of JSON.parse(process.env.OVERWRITE_DATASOURCES)) if (ds.url) url = ds.url;
}
const parsed = new URL(url);
const poolMax = Number(parsed.searchParams.get('connection_limit') || 10);
for (const key of [...parsed.searchParams.keys()]) {
  if (key !== 'options' && key !== 'application_name') parsed.searchParams.delete(key);
}
const pool = new pg.Pool({ connectionString: parsed.toString(), max: poolMax });
const engine = new wasm.QueryEngine(
  { datamodel, logLevel: 'error', logQueries: false, env: process.env, configDir: '.', ignoreEnvVarErrors: true,
    datasourceOverrides: {} },
  (line) => { if (process.env.PRISMA_SHIM_DEBUG) console.error(line); },
  bindAdapter(new PrismaPg(pool)));
await engine.connect('{}');

// model -> field -> type, from the datamodel: Json inputs need a type tag in the JSON protocol
const MODELS = {};
for (const m of datamodel.matchAll(/^model (\w+) \{([\s\S]*?)^\}/gm)) {
  const fields = {};
  for (const line of m[2].split('\n')) {
    const parts = line.trim().split(/\s+/);
    if (parts.length >= 2 && !parts[0].startsWith('//') && !parts[0].startsWith('@@')) {
      fields[parts[0]] = parts[1].replace(/[?[\]]/g, '');
    }
  }
  MODELS[m[1]] = fields;
}

// prisma-client-py sends Json values as JSON text; the GraphQL protocol parsed that text, the JSON
// protocol stores a plain string as a JSON string unless it is tagged as Json.
const jsonTag = (v) => (typeof v === 'string' ? { $type: 'Json', value: v } : v);
function tagJson(value, model) {
  if (Array.isArray(value)) return value.map((v) => tagJson(v, model));
  if (!value || typeof value !== 'object') return value;
  const fields = MODELS[model] || {};
  const out = {};
  for (const [key, v] of Object.entries(value)) {
    const type = fields[key];
    if (type === 'Json') {
      out[key] = v && typeof v === 'object' && !Array.isArray(v)
        ? Object.fromEntries(Object.entries(v).map(([op, x]) => [op, ['set', 'equals', 'not'].includes(op) ? jsonTag(x) : x]))
        : jsonTag(v);
    } else if (type && MODELS[type]) out[key] = tagJson(v, type);
    else if (type) out[key] = v;
    else out[key] = tagJson(v, model); // an operation (create, where, data, AND, ...): same model inside
  }
  return out;
}
const tagArguments = (args, model) => Object.fromEntries(Object.entries(args).map(([k, v]) => [k, tagJson(v, model)]));

// ---- GraphQL (prisma-client-py's subset) -> JSON protocol ----
const ACTIONS = ['findUniqueOrThrow', 'findFirstOrThrow', 'findUnique', 'findFirst', 'findMany', 'createOne',
  'createMany', 'updateOne', 'updateMany', 'deleteOne', 'deleteMany', 'upsertOne', 'aggregate', 'groupBy'];

function tokenize(src) {
  const tokens = [];
  let i = 0;
  while (i < src.length) {
    const c = src[i];
    if (c === ' ' || c === '\n' || c === '\t' || c === '\r' || c === ',') { i++; continue; }
    if ('{}()[]:'.includes(c)) { tokens.push({ p: c }); i++; continue; }
    if (c === '"') {
      let j = i + 1;
      while (src[j] !== '"') j += src[j] === '\\' ? 2 : 1;
      tokens.push({ v: JSON.parse(src.slice(i, j + 1)) });
      i = j + 1;
      continue;
    }
    const m = /^(-?\d+(\.\d+)?([eE][+-]?\d+)?)|^([A-Za-z_][A-Za-z0-9_]*)/.exec(src.slice(i, i + 256));
    if (!m) throw new Error(`cannot tokenize at ${src.slice(i, i + 40)}`);
    if (m[1] !== undefined) tokens.push({ v: Number(m[1]) });
    else if (m[4] === 'true' || m[4] === 'false' || m[4] === 'null') tokens.push({ v: JSON.parse(m[4]) });
    else tokens.push({ n: m[4] });
    i += m[0].length;
  }
  return tokens;
}

function parseDocument(src) {
  const t = tokenize(src);
  let k = 0;
  const peek = () => t[k];
  const expect = (p) => { if (t[k]?.p !== p) throw new Error(`expected ${p}`); k++; };
  function value() {
    const tok = t[k++];
    if ('v' in tok) return tok.v;
    if (tok.n !== undefined) return tok.n; // enum literal
    if (tok.p === '[') { const out = []; while (peek().p !== ']') out.push(value()); k++; return out; }
    if (tok.p === '{') {
      const out = {};
      while (peek().p !== '}') { const key = t[k++].n; expect(':'); out[key] = value(); }
      k++;
      return out;
    }
    throw new Error('bad value');
  }
  function args() {
    const out = {};
    expect('(');
    while (peek().p !== ')') { const key = t[k++].n; expect(':'); out[key] = value(); }
    k++;
    return out;
  }
  function selection() {
    const out = {};
    expect('{');
    while (peek().p !== '}') {
      const name = t[k++].n;
      const field = {};
      if (peek()?.p === '(') field.arguments = args();
      if (peek()?.p === '{') field.selection = selection();
      out[name] = Object.keys(field).length ? field : true;
    }
    k++;
    return out;
  }
  t[k]?.n && k++; // query / mutation
  expect('{');
  let alias = null;
  let name = t[k++].n;
  if (peek().p === ':') { k++; alias = name; name = t[k++].n; }
  const field = { arguments: peek()?.p === '(' ? args() : {}, selection: peek()?.p === '{' ? selection() : {} };
  return { alias, name, field };
}

function toJsonQuery(body) {
  const { alias, name, field } = parseDocument(body.query);
  if (name === 'executeRaw' || name === 'queryRaw') {
    return { alias, key: name, query: { action: name, query: { arguments: field.arguments, selection: {} } } };
  }
  let action = ACTIONS.find((a) => name.startsWith(a) && !a.endsWith('OrThrow'));
  let model = name.slice(action.length);
  if (model.endsWith('OrThrow')) { model = model.slice(0, -'OrThrow'.length); action += 'OrThrow'; }
  const selection = Object.keys(field.selection).length ? field.selection : { $scalars: true };
  const query = { arguments: tagArguments(field.arguments, model), selection };
  return { alias, key: name, query: { modelName: model, action, query } };
}

// JSON-protocol results are typed ({"$type": "DateTime", "value": ...}); the GraphQL protocol sends plain values.
function untag(value) {
  if (Array.isArray(value)) return value.map(untag);
  if (value && typeof value === 'object') {
    if (typeof value.$type === 'string' && 'value' in value) return value.value;
    const out = {};
    for (const [key, v] of Object.entries(value)) out[key] = untag(v);
    return out;
  }
  return value;
}

function rename(result, key, alias, action) {
  if (!result.data) return result;
  let value = untag(result.data[key] ?? result.data[Object.keys(result.data)[0]]);
  if (action === 'queryRaw' && typeof value === 'string') value = JSON.parse(value);
  return { data: { [alias ?? key]: value } };
}

async function handleQuery(raw, txId) {
  const body = JSON.parse(raw);
  if (body.batch) {
    const items = body.batch.map(toJsonQuery);
    const request = { batch: items.map((i) => i.query) };
    if (body.transaction) request.transaction = { isolationLevel: null };
    const out = JSON.parse(await engine.query(JSON.stringify(request), '{}', txId));
    if (!out.batchResult) return out;
    return { batchResult: out.batchResult.map((r, n) => rename(r, items[n].key, items[n].alias, items[n].query.action)) };
  }
  const item = toJsonQuery(body);
  const out = JSON.parse(await engine.query(JSON.stringify(item.query), '{}', txId));
  return rename(out, item.key, item.alias, item.query.action);
}

function read(req) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')));
    req.on('error', reject);
  });
}

async function handle(req, res) {
  let status = 200;
  let out;
  try {
    const body = await read(req);
    const path = req.url.split('?')[0];
    const tx = /^\/transaction\/([^/]+)\/(commit|rollback)$/.exec(path);
    if (req.method === 'GET' && path === '/status') out = { status: 'ok' };
    else if (path === '/metrics') out = { counters: [], gauges: [], histograms: [] };
    else if (req.method === 'POST' && path === '/') out = await handleQuery(body, req.headers['x-transaction-id']);
    else if (req.method === 'POST' && path === '/transaction/start') {
      out = JSON.parse(await engine.startTransaction(body || '{}', '{}'));
    } else if (req.method === 'POST' && tx) {
      const fn = tx[2] === 'commit' ? 'commitTransaction' : 'rollbackTransaction';
      out = JSON.parse((await engine[fn](tx[1], '{}')) || '{}');
    } else { status = 404; out = { errors: [{ error: `no route ${req.method} ${path}` }] }; }
  } catch (err) {
    out = { errors: [{ error: String(err?.message ?? err), user_facing_error: { message: String(err?.message ?? err) } }] };
  }
  const data = JSON.stringify(out);
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(data) });
  res.end(data);
}

// prisma-client-py connects to http://localhost:PORT, which may resolve to either loopback address
const servers = ['127.0.0.1', '::1'].map((host) => {
  const server = http.createServer(handle);
  server.keepAliveTimeout = 60_000;
  server.on('error', () => {}); // no IPv6 loopback here: the IPv4 one is enough
  server.listen(port, host);
  return server;
});

const stop = async () => { servers.forEach((s) => s.close()); await engine.disconnect('{}').catch(() => {}); await pool.end(); process.exit(0); };
process.on('SIGINT', stop);
process.on('SIGTERM', stop);
