// The gpuflow dashboard. It reads the /v1 API with the token the user signs
// in with (kept in this tab's session storage), so it shows what that
// token's role may see and nothing more. Everything from the API is written
// as text (never as markup): names come from tenants.
'use strict';

const KEY = 'gpuflow.token';
const S = { token: sessionStorage.getItem(KEY), me: null };

// ---- DOM ----

function el(tag, attrs, ...kids) {
  const n = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) n.addEventListener(k.slice(2), v);
    else if (k === 'style') n.style.cssText = v;
    else n.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of kids.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    n.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return n;
}
const SVG = 'http://www.w3.org/2000/svg';
function sv(tag, attrs, ...kids) {
  const n = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) n.setAttribute(k, String(v));
  for (const c of kids.flat(Infinity)) n.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return n;
}
function mount(...kids) {
  const m = document.getElementById('main');
  m.replaceChildren(...kids);
}

// ---- the API ----

class Unauthorized extends Error {}

async function api(path) {
  const r = await fetch(path, { headers: { Authorization: 'Bearer ' + S.token } });
  if (r.status === 401) {
    let why = 'it is unknown, revoked or expired';
    try { why = (await r.json()).message || why; } catch (_) { /* not JSON */ }
    throw new Unauthorized(why);
  }
  let body = null;
  try { body = await r.json(); } catch (_) { /* not JSON */ }
  if (!r.ok) {
    const msg = body && body.message ? body.message : r.status + ' ' + r.statusText;
    throw new Error(path.split('?')[0] + ': ' + msg);
  }
  return body;
}

async function apiPost(path) {
  const r = await fetch(path, { method: 'POST', headers: { Authorization: 'Bearer ' + S.token } });
  if (r.status === 401) throw new Unauthorized('the token was not accepted');
  let body = null;
  try { body = await r.json(); } catch (_) { /* not JSON */ }
  if (!r.ok) throw new Error(body && body.message ? body.message : r.status + ' ' + r.statusText);
  return body;
}

// ---- formatting ----

const now = () => Math.floor(Date.now() / 1000);
function when(t) {
  if (!t) return '—';
  const d = new Date(t * 1000);
  return d.toISOString().replace('T', ' ').slice(0, 16) + ' UTC';
}
function age(t) {
  if (!t) return '—';
  let s = Math.max(0, now() - t);
  if (s < 90) return s + 's';
  if (s < 5400) return Math.round(s / 60) + 'm';
  if (s < 172800) return Math.round(s / 3600) + 'h';
  return Math.round(s / 86400) + 'd';
}
function until(t) {
  const s = t - now();
  if (s <= 0) return 'now';
  if (s < 5400) return 'in ' + Math.round(s / 60) + 'm';
  if (s < 172800) return 'in ' + Math.round(s / 3600) + 'h';
  return 'in ' + Math.round(s / 86400) + 'd';
}
const num = (x, d = 1) => (x === undefined || x === null ? '—' : Number(x).toFixed(d));
// A quantity readable at any size: 1234, 12.3, 0.042.
function qty(x) {
  if (x === undefined || x === null) return '—';
  const a = Math.abs(x);
  if (a === 0) return '0';
  if (a >= 100) return x.toFixed(0);
  if (a >= 1) return x.toFixed(1);
  return Number(x.toPrecision(2)).toString();
}
const pct = (x) => (x === undefined || x === null ? '—' : Math.round(x) + '%');
const money = (x, c) => (x === undefined || x === null ? '—' : (c ? c + ' ' : '') + Number(x).toFixed(2));
const badge = (s) => el('span', { class: 'badge ' + s }, s);

// GPUs to two places at most: 0.25 stays 0.25, 2 stays 2.
const gpus = (x) => (x === undefined || x === null ? '—' : String(Number(Number(x).toFixed(2))));

// Colours far apart from each other, for the teams the token may see
// (in name order, so the same on every page and visit while the teams
// stay the same); names beyond them, and users or queues, by a hash.
const PALETTE = ['#4c78a8', '#f58518', '#54a24b', '#e45756', '#72b7b2', '#b279a2', '#eeca3b',
  '#9d755d', '#ff9da6', '#bab0ac', '#1f77b4', '#2ca02c', '#d62728', '#9467bd', '#8c564b',
  '#e377c2', '#17becf', '#bcbd22', '#393b79', '#637939'];
function colour(team) {
  if (!team) return '#adb5bd';
  const k = (S.teams || []).indexOf(team);
  if (k >= 0 && k < PALETTE.length) return PALETTE[k];
  let h = 2166136261;
  for (const ch of team) h = Math.imul(h ^ ch.charCodeAt(0), 16777619) >>> 0;
  return PALETTE[h % PALETTE.length];
}

// ---- pages ----

const PAGES = [
  ['cluster', 'Cluster'],
  ['queues', 'Queues'],
  ['jobs', 'Jobs'],
  ['usage', 'Usage & cost'],
  ['efficiency', 'Efficiency'],
];

function shell(on) {
  const who = S.me ? S.me.user + ' · ' + S.me.role + (S.me.team ? ' · ' + S.me.team : '') : '';
  return [
    el('header', { class: 'top' },
      el('div', { class: 'brand' }, 'gpu', el('span', {}, 'flow')),
      el('nav', {}, PAGES.map(([k, t]) => el('a', { href: '#/' + k, class: k === on ? 'on' : null, 'data-page': k }, t))),
      el('span', { class: 'who', id: 'who' }, who),
      el('span', { class: 'muted', id: 'updated', title: 'The page is read again every 10 s' },
        'live · ' + new Date().toLocaleTimeString()),
      el('button', { class: 'plain', id: 'logout', onclick: logout }, 'Sign out')),
    el('main', { id: 'main' }, el('p', { class: 'muted' }, 'Loading…')),
  ];
}

// ---- sign-in through an identity provider (authorization code + PKCE) ----

const OIDC = 'gpuflow.oidc';

function b64url(bytes) {
  return btoa(String.fromCharCode(...bytes)).replace(/\+/g, '-').replace(/\//g, '_').replace(/=+$/, '');
}

function random() {
  return b64url(crypto.getRandomValues(new Uint8Array(32)));
}

// To the provider, with a PKCE challenge, a state and a nonce kept in
// this tab; it sends the browser back to /ui/ with a code.
async function signInWith(p) {
  const verifier = random();
  const digest = await crypto.subtle.digest('SHA-256', new TextEncoder().encode(verifier));
  const state = random();
  const nonce = random();
  const redirect = location.origin + '/ui/';
  sessionStorage.setItem(OIDC, JSON.stringify({ provider: p.name, verifier, state, nonce, redirect }));
  const u = new URL(p.authorization_endpoint);
  u.search = new URLSearchParams({
    response_type: 'code', client_id: p.client_id, redirect_uri: redirect, scope: p.scopes,
    state, nonce, code_challenge: b64url(new Uint8Array(digest)), code_challenge_method: 'S256',
  }).toString();
  location.assign(u.toString());
}

// Back from the provider: the code goes to the server (which exchanges it,
// once, and checks the ID token's nonce) for a session token. True when
// the page is settled (signed in, or the sign-in form with why not).
async function finishSignIn() {
  const q = new URLSearchParams(location.search);
  if (!q.has('code') && !q.has('error')) return false;
  const saved = JSON.parse(sessionStorage.getItem(OIDC) || 'null');
  sessionStorage.removeItem(OIDC);
  history.replaceState(null, '', location.pathname + location.hash);
  if (q.has('error')) {
    login('The provider did not sign you in: ' + q.get('error') + '.');
    return true;
  }
  if (!saved || saved.state !== q.get('state')) {
    login('That sign-in did not start in this tab (its state does not match): sign in again.');
    return true;
  }
  const r = await fetch('/v1/auth/code', {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ provider: saved.provider, code: q.get('code'), code_verifier: saved.verifier,
      redirect_uri: saved.redirect, nonce: saved.nonce }),
  });
  let v = {};
  try { v = await r.json(); } catch (_) { /* not JSON */ }
  if (r.status !== 201) {
    login('The sign-in was refused: ' + (v.message || r.status + ' ' + r.statusText));
    return true;
  }
  S.token = v.token;
  sessionStorage.setItem(KEY, S.token);
  S.me = null;
  return false;
}

// The provider buttons under the token form, when the server has any.
async function providerButtons() {
  let list = [];
  try { list = await (await fetch('/v1/auth/providers')).json(); } catch (_) { return; }
  const box = document.getElementById('providers');
  if (!box || !Array.isArray(list)) return;
  box.replaceChildren(...list.filter((p) => p.authorization_endpoint).map((p) =>
    el('button', { type: 'button', class: 'provider', 'data-provider': p.name, onclick: () => signInWith(p) },
      'Sign in with ' + p.name)));
}

function login(message) {
  document.getElementById('app').replaceChildren(
    el('div', { class: 'panel login' },
      el('h1', {}, 'Sign in to gpuflow'),
      el('div', { id: 'providers' }),
      el('p', {}, 'Paste an API token. An admin creates one with ', el('code', {}, 'gpuflow token create'),
        '; the token of ', el('code', {}, 'gpuflow up'), ' is in its data directory (admin.token).'),
      message ? el('div', { class: 'error', id: 'login-error' }, message) : null,
      el('form', { id: 'login', onsubmit: async (e) => {
        e.preventDefault();
        S.token = document.getElementById('token').value.trim();
        sessionStorage.setItem(KEY, S.token);
        S.me = null;
        await route();
      } },
        el('input', { id: 'token', type: 'password', autocomplete: 'off', placeholder: 'gft_…', required: true }),
        el('button', { type: 'submit', id: 'signin' }, 'Sign in'))));
  providerButtons();
}

function logout() {
  sessionStorage.removeItem(KEY);
  S.token = null;
  S.me = null;
  location.hash = '#/cluster';
  login();
}

async function route() {
  if (!S.token) return login();
  const [page, arg] = (location.hash.replace(/^#\//, '').split('?')[0] || 'cluster').split('/');
  try {
    if (!S.me) {
      S.me = await api('/v1/whoami');
      S.teams = (await api('/v1/teams')).map((t) => t.name).sort();
    }
    document.getElementById('app').replaceChildren(...shell(page));
    if (page === 'cluster') await cluster();
    else if (page === 'queues') await queues();
    else if (page === 'jobs' && arg) await job(arg);
    else if (page === 'jobs') await jobs();
    else if (page === 'usage') await usage();
    else if (page === 'efficiency') await efficiency();
    else mount(el('div', { class: 'error' }, 'No page ' + page + '.'));
  } catch (e) {
    if (e instanceof Unauthorized) {
      sessionStorage.removeItem(KEY);
      S.token = null;
      return login('That token was not accepted: ' + e.message);
    }
    mount(el('div', { class: 'error', id: 'error' }, e.message));
  }
}

// The cluster map: nodes × GPUs, coloured by the holding team, hatched
// when shared, split by MIG instance, outlined red when unhealthy.
async function cluster() {
  const [nodes, idle] = await Promise.all([api('/v1/nodes'), api('/v1/idle-waiting')]);
  let gpus = 0, busy = 0, bad = 0;
  const teams = new Set();
  const cards = nodes.map((n) => {
    const util = new Map((n.gpus_now || []).map((g) => [g.uuid, g]));
    const cells = n.inventory.gpus.map((g) => {
      gpus += 1;
      const holds = (n.holders || []).filter((h) => h.gpu === g.index);
      if (holds.length) busy += 1;
      if (g.unhealthy) bad += 1;
      holds.forEach((h) => teams.add(h.team));
      const segs = holds.map((h) => el('div', {
        class: 'seg' + (h.mode === 'fraction' || h.mode === 'time-slice' ? ' shared' : '') + (h.mode === 'mig' ? ' mig' : ''),
        style: 'width:' + Math.min(100, h.milli / 10) + '%;background-color:' + colour(h.team),
        title: (h.team || 'another team') + (h.job ? ' · job ' + h.job : '') + ' · ' + h.mode +
          (h.profile ? ' ' + h.profile : '') + (h.mode === 'whole' ? '' : ' · ' + h.milli / 10 + '%'),
      }));
      const s = util.get(g.uuid);
      const label = g.mig && g.mig.length ? 'MIG ' + holds.length + '/' + g.mig.length
        : holds.length === 1 && holds[0].mode === 'whole' ? (holds[0].team || 'other team')
          : holds.length ? 'shared ×' + holds.length : 'free';
      return el('div', {
        class: 'gpu' + (g.unhealthy ? ' unhealthy' : ''),
        'data-node': n.name, 'data-gpu': g.index, 'data-team': holds.map((h) => h.team).join(','),
        title: 'GPU ' + g.index + ' · ' + g.model + ' · ' + Math.round(g.memory_mib / 1024) + ' GiB' +
          (g.mig && g.mig.length ? ' · MIG: ' + g.mig.map((m) => m.profile).join(', ') : '') +
          (s ? ' · ' + s.util_pct + '% busy, ' + Math.round(s.memory_used_mib / 1024) + ' GiB used' : '') +
          (g.unhealthy ? ' · UNHEALTHY: ' + g.unhealthy : ''),
      }, segs, el('span', { class: 'lbl' }, g.index + ' ' + label),
      s ? el('div', { class: 'util', style: 'width:' + s.util_pct + '%' }) : null);
    });
    const model = [...new Set(n.inventory.gpus.map((g) => g.model))].join(', ');
    return el('div', { class: 'node', 'data-node': n.name },
      el('div', { class: 'head' },
        el('b', {}, n.name), badge(n.state),
        (n.reservations || []).map((r) => el('span', { class: 'badge reserved', title: r, 'data-reservation': r.split(' ')[0] }, 'reserved: ' + r.split(' ')[0]))),
      el('div', { class: 'muted', style: 'margin-bottom:8px' },
        (n.inventory.pool || 'default') + ' · ' + (model || 'no GPUs') + (n.inventory.emulated ? ' (emulated)' : '') +
        ' · heartbeat ' + age(n.last_heartbeat) + ' ago'),
      el('div', { class: 'gpus' }, cells));
  });
  const legend = [...teams].sort().map((t) => el('span', {}, el('i', { style: 'background:' + colour(t) }), t || 'other teams'));
  mount(
    el('h1', {}, 'Cluster'),
    el('div', { class: 'cards' },
      stat('Nodes', nodes.length), stat('GPUs', gpus), stat('GPUs in use', busy),
      stat('Free GPUs', gpus - busy - bad), stat('Unhealthy', bad),
      el('div', {
        class: 'card', id: 'idle-waiting',
        title: 'GPUs free after the last scheduling cycle that waiting jobs could hold, quotas aside: ' +
          idle.gpu_hours.toFixed(1) + ' GPU-hours since the server started',
      }, el('div', { class: 'k' }, 'Idle while work waits'),
      el('div', { class: 'v' }, +idle.gpus.toFixed(2) + (idle.gpus === 1 ? ' GPU' : ' GPUs')))),
    el('div', { class: 'legend' },
      el('span', {}, el('i', { style: 'background:var(--free)' }), 'free'),
      el('span', {}, el('i', { style: 'background:repeating-linear-gradient(45deg,#999 0 3px,#ddd 3px 6px)' }), 'shared (fraction, time slice)'),
      legend),
    nodes.length ? el('div', { class: 'nodes', id: 'cluster-map' }, cards)
      : el('div', { class: 'panel muted' }, 'No nodes have registered yet.'));
}

function stat(k, v) {
  return el('div', { class: 'card' }, el('div', { class: 'k' }, k), el('div', { class: 'v' }, v));
}

// A queue's figure per GPU model (`H100 8 · A10 2`): guarantees of
// different models are not one number.
function perModel(m, f) {
  const e = Object.entries(m || {}).filter(([, v]) => v !== undefined && v !== null);
  if (!e.length) return '0';
  return e.map(([k, v]) => (k === '*' ? 'any model' : k) + ' ' + f(v)).join(' · ');
}

async function queues() {
  const qs = await api('/v1/queues');
  const rows = qs.map((q) => {
    const guaranteedOf = (f) => (((q.quotas || {})[f] || (q.quotas || {})['*'] || {}).guaranteed || 0);
    const borrowedBy = Object.fromEntries(Object.entries(q.used || {})
      .map(([f, u]) => [f, Math.max(0, u - guaranteedOf(f))]).filter(([, b]) => b > 0));
    const guaranteed = perModel(Object.fromEntries(Object.entries(q.quotas || {}).map(([f, x]) => [f, x.guaranteed])),
      (g) => (g >= 1e6 ? 'all' : gpus(g)));
    const b = q.budget_use;
    const budget = budgetCell(q.budget, b);
    return el('tr', { 'data-queue': q.name },
      el('td', {}, el('b', {}, q.name)), el('td', {}, q.team), el('td', {}, badge(q.state || 'open')),
      el('td', { class: 'num' }, num(q.weight, 1)),
      el('td', { class: 'num', 'data-col': 'guaranteed' }, guaranteed),
      el('td', { class: 'num', 'data-col': 'used' }, perModel(q.used, gpus)),
      el('td', { class: 'num' }, perModel(borrowedBy, gpus)),
      el('td', { class: 'num' }, q.pending), el('td', { class: 'num' }, q.running),
      el('td', {}, budget));
  });
  mount(el('h1', {}, 'Queues'),
    el('div', { class: 'panel' }, el('table', { id: 'queues' },
      el('thead', {}, el('tr', {}, ['Queue', 'Team', 'State', 'Weight', 'Guaranteed', 'In use', 'Borrowed', 'Pending', 'Running', 'Budget']
        .map((h, i) => el('th', { class: i >= 3 && i <= 8 ? 'num' : null }, h)))),
      el('tbody', {}, rows))));
}

// A budget as it stands: a bar of what is used, and what is left.
function budgetCell(spec, b) {
  if (!spec || !b) return el('span', { class: 'muted' }, 'none');
  const limit = spec.gpu_hours ?? spec.cost ?? 0;
  const unit = b.unit === 'cost' ? '' : ' GPU-h';
  return el('div', { class: 'budget' },
    el('div', { class: 'bar' + (b.exhausted ? ' over' : '') },
      el('div', { style: 'width:' + Math.min(100, 100 * b.used / Math.max(1e-9, limit)) + '%' })),
    el('span', { class: 'muted' }, qty(b.left) + ' of ' + qty(limit) + unit + ' left this ' + spec.period +
      (b.exhausted ? ' · spent' : b.weight_factor < 1 ? ' · weight ×' + num(b.weight_factor, 2) : '')));
}

const GROUPS = {
  active: ['pending', 'held', 'suspended', 'admitted', 'starting', 'running', 'stopping'],
  pending: ['pending', 'held', 'suspended'],
  running: ['admitted', 'starting', 'running', 'stopping'],
  finished: ['succeeded', 'failed', 'timeout', 'cancelled'],
  all: null,
};

// A job's GPUs as its quota counts them: what it holds (or held last) from
// its ledger; for one not yet placed, whole GPUs and fractions, a MIG
// profile or a time slice by name (their share depends on the node).
function gpusOf(j) {
  const held = (j.ledger || [])[(j.ledger || []).length - 1];
  if (held) return gpus(held.gpus);
  let n = 0;
  const shared = [];
  for (const t of j.spec.tasks || []) {
    const g = (t.resources || {}).gpu;
    if (!g) continue;
    const r = t.replicas || 1;
    if (!g.mode || g.mode === 'whole') n += (g.count || 1) * r;
    else if (g.mode === 'fraction') n += (g.fraction || 0) * r;
    else shared.push((r > 1 ? r + '×' : '') + (g.mode === 'mig' ? g.profile : 'slice'));
  }
  return shared.length ? (n ? [gpus(n)] : []).concat(shared).join('+') : gpus(n);
}

async function jobs() {
  const p = new URLSearchParams(location.hash.split('?')[1] || '');
  const group = p.get('show') || 'active';
  const all = await api('/v1/jobs?limit=1000');
  const want = GROUPS[group];
  const text = (p.get('q') || '').toLowerCase();
  const list = all.filter((j) => (!want || want.includes(j.state)) &&
    (!text || (j.name + ' ' + j.user + ' ' + j.team + ' ' + j.queue).toLowerCase().includes(text)));
  const set = (k, v) => {
    p.set(k, v);
    location.hash = '#/jobs?' + p.toString();
  };
  mount(el('h1', {}, 'Jobs'),
    el('div', { class: 'filters' },
      el('select', { id: 'show', onchange: (e) => set('show', e.target.value) },
        Object.keys(GROUPS).map((g) => el('option', { value: g, selected: g === group }, g))),
      el('input', { id: 'search', placeholder: 'name, user, team or queue', value: p.get('q') || '',
        onchange: (e) => set('q', e.target.value) }),
      el('span', { class: 'muted' }, list.length + ' of ' + all.length + ' jobs')),
    el('div', { class: 'panel' }, list.length ? el('table', { id: 'jobs' },
      el('thead', {}, el('tr', {}, ['ID', 'Name', 'Team', 'Queue', 'User', 'Kind', 'GPUs', 'State', 'Age', 'Reason']
        .map((h) => el('th', { class: h === 'ID' || h === 'GPUs' ? 'num' : null }, h)))),
      el('tbody', {}, list.map((j) => el('tr', { class: 'link', 'data-job': j.id, onclick: () => { location.hash = '#/jobs/' + j.id; } },
        el('td', { class: 'num' }, el('a', { href: '#/jobs/' + j.id }, j.id)), el('td', {}, j.name), el('td', {}, j.team),
        el('td', {}, j.queue), el('td', {}, j.user), el('td', {}, j.spec.kind || 'training'),
        el('td', { class: 'num', 'data-col': 'gpus' }, gpusOf(j)), el('td', {}, badge(j.state)),
        el('td', {}, age(j.submitted_at)), el('td', { class: 'muted' }, j.reason)))))
      : el('p', { class: 'muted' }, 'No ' + group + ' jobs.')));
}

async function job(id) {
  const j = await api('/v1/jobs/' + encodeURIComponent(id));
  const waiting = ['pending', 'held', 'suspended'].includes(j.state);
  const [why, events, logs] = await Promise.all([
    waiting ? api('/v1/jobs/' + j.id + '/why') : null,
    api('/v1/events?job=' + j.id),
    api('/v1/jobs/' + j.id + '/logs?tail_bytes=65536'),
  ]);
  const gh = (j.ledger || []).reduce((a, h) => a + h.gpu_hours, 0);
  // Its tasks' web interfaces: the proxy lets a browser in with a cookie
  // for this job's proxy path, asked for before the links are shown.
  const ports = (j.tasks || []).flatMap((t) => (t.ports || []).map((p) => [t, p]));
  if (ports.length) await apiPost('/v1/jobs/' + j.id + '/proxy-session');
  const parts = [
    el('h1', {}, 'Job ' + j.id + ' · ' + j.name + ' ', badge(j.state)),
    actions(j),
    ports.length ? el('div', { class: 'actions', id: 'open' }, ports.map(([t, p]) => el('a', {
      class: 'button', href: p.url, target: '_blank', rel: 'noopener noreferrer',
      title: t.group + '/' + t.index + ' port ' + p.port,
    }, 'Open ' + p.name))) : null,
    el('div', { class: 'panel facts' },
      fact('Team', j.team), fact('Queue', j.queue), fact('User', j.user), fact('Kind', j.spec.kind || 'training'),
      fact('Submitted', when(j.submitted_at)), fact('Started', when(j.started_at)), fact('Finished', when(j.finished_at)),
      fact('Attempts', j.attempts), fact('Preemptions', j.preemptions), fact('Last checkpoint', when(j.last_checkpoint)),
      fact('GPU-hours', qty(gh)), why ? null : fact('Reason', j.reason),
      j.external ? fact('Runs on', 'Kubernetes cluster ' + j.external.cluster + ' (' + j.external.key + ')') : null),
  ];
  if (why) {
    parts.push(el('div', { class: 'panel why', id: 'why' },
      el('h2', {}, 'Why it waits'),
      el('div', {}, why.summary),
      el('div', { class: 'muted' },
        (why.position ? 'Position ' + why.position + ' in its queue. ' : '') +
        (why.eta && why.eta > now() + 60 ? 'Expected to start ' + until(why.eta) + ' (' + when(why.eta) + ').'
          : 'No start time can be estimated yet.')),
      el('ul', {}, why.reasons.map((r) => el('li', {}, r)))));
  }
  if (j.tasks && j.tasks.length) {
    parts.push(el('div', { class: 'panel' }, el('h2', {}, 'Tasks'), el('table', { id: 'tasks' },
      el('thead', {}, el('tr', {}, ['Task', 'Node', 'GPUs', 'State', 'Exit', 'GPU util (mean)', 'GPU memory (peak)'].map((h) => el('th', {}, h)))),
      el('tbody', {}, j.tasks.map((t) => el('tr', {},
        el('td', {}, t.group + '/' + t.index), el('td', {}, t.node),
        el('td', {}, t.gpus.join(',') + (t.milli ? ' (' + t.milli / 10 + '%)' : '')), el('td', {}, t.state),
        el('td', {}, t.exit_code ?? '—'),
        el('td', {}, t.usage ? pct(t.usage.gpu_util_avg_pct) : '—'),
        el('td', {}, t.usage ? Math.round(t.usage.gpu_memory_peak_mib) + ' MiB' : '—')))))));
  }
  parts.push(el('div', { class: 'panel', id: 'util' }, el('h2', {}, 'GPU utilisation'),
    (j.util || []).length ? lineChart(j.util.map((p) => [p.at, p.util_pct]), '%', 100)
      : el('p', { class: 'muted' }, 'No samples yet: utilisation appears once its tasks run on GPUs.')));
  parts.push(el('div', { class: 'grid2' },
    el('div', { class: 'panel' }, el('h2', {}, 'Events'), el('ul', { class: 'timeline', id: 'events' },
      events.map((e) => el('li', {}, el('span', { class: 'at' }, when(e.at)), el('b', {}, e.kind), ' ', e.message)))),
    el('div', { class: 'panel' }, el('h2', {}, 'Logs (latest attempt)'),
      Object.keys(logs.tasks).length
        ? [Object.entries(logs.tasks).map(([k, v]) => [el('div', { class: 'muted' }, k + ' · stdout'), el('pre', { class: 'log' }, v)]),
          Object.entries(logs.stderr || {}).filter(([, v]) => v).map(([k, v]) => [el('div', { class: 'muted' }, k + ' · stderr'), el('pre', { class: 'log err' }, v)])]
        : el('p', { class: 'muted' }, 'No output yet.'))));
  mount(...parts);
  // Logs open at their end, where the latest output is.
  document.querySelectorAll('pre.log').forEach((p) => { p.scrollTop = p.scrollHeight; });
}

// What the signed-in user may do to a job, as buttons: cancel, suspend and
// resume for its team's members and lead (and admins), hold and release
// for admins; the server checks again.
function actions(j) {
  const me = S.me || {};
  const admin = me.role === 'admin';
  const owner = admin || (me.team === j.team && ['member', 'team-lead'].includes(me.role));
  if (!owner || GROUPS.finished.includes(j.state) || j.external) return null;
  const can = [
    ['cancel', true],
    ['suspend', ['pending', 'running', 'starting', 'admitted'].includes(j.state)],
    ['resume', j.state === 'suspended'],
    ['hold', admin && j.state === 'pending'],
    ['release', admin && j.state === 'held'],
  ].filter(([, ok]) => ok);
  const out = el('div', { class: 'error', id: 'action-error', style: 'display:none' });
  return el('div', { class: 'actions', id: 'actions' },
    can.map(([a]) => el('button', {
      'data-action': a,
      onclick: async () => {
        if (a === 'cancel' && !window.confirm('Cancel job ' + j.id + '?')) return;
        try {
          await apiPost('/v1/jobs/' + j.id + '/' + a);
          await route();
        } catch (e) {
          out.style.display = '';
          out.textContent = a + ': ' + e.message;
        }
      },
    }, a)), out);
}

function fact(k, v) {
  return el('div', {}, el('b', {}, k), v === undefined || v === null ? '—' : v);
}

// A line chart of [t, y] points.
function lineChart(points, unit, top) {
  const W = 800, H = 220, L = 40, B = 24;
  const t0 = points[0][0], t1 = Math.max(points[points.length - 1][0], t0 + 1);
  const ymax = top || Math.max(1e-9, ...points.map((p) => p[1]));
  const x = (t) => L + (W - L - 8) * (t - t0) / (t1 - t0);
  const y = (v) => H - B - (H - B - 8) * v / ymax;
  const d = points.map((p, i) => (i ? 'L' : 'M') + x(p[0]).toFixed(1) + ' ' + y(p[1]).toFixed(1)).join(' ');
  return sv('svg', { class: 'chart', viewBox: '0 0 ' + W + ' ' + H, role: 'img' },
    [0, 0.5, 1].map((f) => [sv('line', { x1: L, x2: W, y1: y(ymax * f), y2: y(ymax * f), stroke: '#e2e5eb' }),
      sv('text', { x: 4, y: y(ymax * f) + 4 }, Math.round(ymax * f) + unit)]),
    sv('text', { x: L, y: H - 6 }, when(t0)), sv('text', { x: W - 140, y: H - 6 }, when(t1)),
    sv('path', { d, fill: 'none', stroke: '#3b5bdb', 'stroke-width': 2 }),
    points.map((p) => sv('circle', { cx: x(p[0]), cy: y(p[1]), r: 2.5, fill: '#3b5bdb' })));
}

const PERIOD_S = { hour: 3600, day: 86400, month: 30 * 86400 };

// Stacked bars on a time axis over the whole range asked for (`from` ago
// to now): one bar per period, as wide as the period, one segment per key.
function barChart(rows, field, period, rangeS) {
  const W = 800, H = 240, L = 48, B = 24;
  const periods = [...new Set(rows.map((r) => r.period_start))].sort((a, b) => a - b);
  const keys = [...new Set(rows.map((r) => r.key))].sort();
  const total = (p) => rows.filter((r) => r.period_start === p).reduce((a, r) => a + r[field], 0);
  const ymax = Math.max(1e-9, ...periods.map(total));
  const len = PERIOD_S[period] || 86400;
  const t1 = now();
  const t0 = Math.min(t1 - rangeS, periods.length ? periods[0] : t1 - rangeS);
  const x = (t) => L + (W - L - 8) * (t - t0) / Math.max(1, t1 + len - t0);
  const bw = Math.max(2, (x(t0 + len) - x(t0)) * 0.85);
  const label = (t) => (period === 'hour' ? when(t).slice(0, 16) : when(t).slice(0, 10));
  const bars = [];
  periods.forEach((p) => {
    let base = 0;
    for (const k of keys) {
      const r = rows.find((r) => r.period_start === p && r.key === k);
      if (!r || !r[field]) continue;
      const h = (H - B - 8) * r[field] / ymax;
      bars.push(sv('rect', { x: x(p), y: H - B - base - h, width: bw, height: h, fill: colour(k), 'data-key': k, 'data-period': p },
        sv('title', {}, k + ' · ' + label(p) + ' · ' + qty(r[field]))));
      base += h;
    }
  });
  return el('div', {},
    sv('svg', { class: 'chart', id: 'usage-chart', viewBox: '0 0 ' + W + ' ' + H, role: 'img' },
      [0, 0.5, 1].map((f) => [sv('line', { x1: L, x2: W, y1: H - B - (H - B - 8) * f, y2: H - B - (H - B - 8) * f, stroke: '#e2e5eb' }),
        sv('text', { x: 4, y: H - B - (H - B - 8) * f + 4 }, qty(ymax * f))]),
      [t0, (t0 + t1) / 2, t1].map((t, i) => sv('text', {
        x: i === 0 ? L : i === 1 ? (L + W) / 2 - 40 : W - (period === 'hour' ? 130 : 80), y: H - 6, class: 'axis',
      }, label(Math.floor(t)))),
      bars),
    el('div', { class: 'legend' }, keys.map((k) => el('span', {}, el('i', { style: 'background:' + colour(k) }), k))));
}

async function usage() {
  const p = new URLSearchParams(location.hash.split('?')[1] || '');
  const by = p.get('by') || 'team';
  const period = p.get('period') || 'day';
  const from = p.get('from') || '30d';
  const field = p.get('show') || 'gpu_hours';
  const q = new URLSearchParams({ by, period, from });
  const [rep, totals, waits] = await Promise.all([
    api('/v1/reports/usage?' + q),
    api('/v1/reports/usage?' + new URLSearchParams({ by, period: 'all', from })),
    api('/v1/reports/jobs?' + new URLSearchParams({ by: 'kind', from })),
  ]);
  const set = (k, v) => {
    p.set(k, v);
    location.hash = '#/usage?' + p.toString();
  };
  const pick = (id, k, v, opts) => el('select', { id, onchange: (e) => set(k, e.target.value) },
    opts.map(([val, text]) => el('option', { value: val, selected: val === v }, text)));
  mount(el('h1', {}, 'Usage & cost'),
    el('div', { class: 'filters' },
      pick('by', 'by', by, ['team', 'project', 'user', 'queue', 'model', 'cost_centre'].map((x) => [x, 'by ' + x])),
      pick('period', 'period', period, [['hour', 'per hour'], ['day', 'per day'], ['month', 'per month']]),
      pick('from', 'from', from, [['1d', 'last day'], ['7d', 'last 7 days'], ['30d', 'last 30 days'], ['90d', 'last 90 days'], ['365d', 'last year']]),
      pick('show', 'show', field, [['gpu_hours', 'GPU-hours held'], ['used_gpu_hours', 'GPU-hours used'], ['cost', 'cost']])),
    el('div', { class: 'panel' }, el('h2', {}, (field === 'cost' ? 'Cost' : 'GPU-hours') + ' by ' + by),
      rep.rows.length ? barChart(rep.rows, field, period, parseInt(from, 10) * 86400)
        : el('p', { class: 'muted' }, 'No GPU time was held in this range.')),
    el('div', { class: 'grid2' },
      el('div', { class: 'panel' }, el('h2', {}, 'Totals'), el('table', { id: 'usage-totals' },
        el('thead', {}, el('tr', {}, [by, 'GPU-h', 'Used GPU-h', 'Efficiency', 'Cost', 'Jobs'].map((h, i) => el('th', { class: i ? 'num' : null }, h)))),
        el('tbody', {}, totals.rows.map((r) => el('tr', { 'data-key': r.key },
          el('td', {}, el('i', { style: 'display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px;background:' + colour(r.key) }), r.key),
          el('td', { class: 'num' }, qty(r.gpu_hours)), el('td', { class: 'num' }, qty(r.used_gpu_hours)),
          el('td', { class: 'num' }, r.efficiency === undefined ? '—' : pct(100 * r.efficiency)),
          el('td', { class: 'num' }, money(r.cost, totals.currency)), el('td', { class: 'num' }, r.jobs)))))),
      el('div', { class: 'panel' }, el('h2', {}, 'Waits and outcomes by kind'), el('table', { id: 'waits' },
        el('thead', {}, el('tr', {}, ['Kind', 'Submitted', 'Wait p50', 'Wait p95', 'Failed', 'Preemptions', 'GPU-h lost'].map((h, i) => el('th', { class: i ? 'num' : null }, h)))),
        el('tbody', {}, waits.map((r) => el('tr', {},
          el('td', {}, r.key), el('td', { class: 'num' }, r.submitted),
          el('td', { class: 'num' }, r.wait_p50_s === undefined ? '—' : dur(r.wait_p50_s)),
          el('td', { class: 'num' }, r.wait_p95_s === undefined ? '—' : dur(r.wait_p95_s)),
          el('td', { class: 'num' }, r.failed), el('td', { class: 'num' }, r.preemptions),
          el('td', { class: 'num' }, num(r.lost_gpu_hours, 2)))))))));
}

function dur(s) {
  if (s < 90) return s + 's';
  if (s < 5400) return Math.round(s / 60) + 'm';
  return num(s / 3600, 1) + 'h';
}

async function efficiency() {
  const p = new URLSearchParams(location.hash.split('?')[1] || '');
  const below = p.get('below') || '10';
  const held = p.get('for') || '1h';
  const [low, advice, nodes] = await Promise.all([
    api('/v1/reports/low-utilization?' + new URLSearchParams({ below_pct: below, for: held })),
    api('/v1/reports/advice'),
    api('/v1/nodes'),
  ]);
  // Only sampled GPUs can be judged; say so when none is.
  const sampled = nodes.some((n) => (n.gpus_now || []).length);
  const set = (k, v) => {
    p.set(k, v);
    location.hash = '#/efficiency?' + p.toString();
  };
  mount(el('h1', {}, 'Efficiency'),
    el('div', { class: 'panel' },
      el('h2', {}, 'Jobs holding GPUs they barely use'),
      el('div', { class: 'filters' },
        'below', el('select', { id: 'below', onchange: (e) => set('below', e.target.value) },
          ['5', '10', '25', '50'].map((v) => el('option', { value: v, selected: v === below }, v + '% busy'))),
        'for at least', el('select', { id: 'for', onchange: (e) => set('for', e.target.value) },
          ['1m', '10m', '1h', '4h', '1d'].map((v) => el('option', { value: v, selected: v === held }, v)))),
      low.length ? el('table', { id: 'low-use' },
        el('thead', {}, el('tr', {}, ['Job', 'Name', 'Team', 'User', 'Kind', 'GPUs', 'Since', 'Util', 'GPU-h held'].map((h) => el('th', {}, h)))),
        el('tbody', {}, low.map((r) => el('tr', { class: 'link', onclick: () => { location.hash = '#/jobs/' + r.id; } },
          el('td', {}, el('a', { href: '#/jobs/' + r.id }, r.id)), el('td', {}, r.name), el('td', {}, r.team), el('td', {}, r.user),
          el('td', {}, r.kind), el('td', {}, gpus(r.gpus)), el('td', {}, age(r.since) + ' ago'), el('td', {}, pct(r.util_pct)),
          el('td', {}, qty(r.gpu_hours))))))
        : el('p', { class: 'muted', id: 'low-use-none' }, sampled
          ? 'None: every sampled job holding GPUs for that long uses them.'
          : 'No utilisation samples: no node reports its GPUs\' use (emulated GPUs, or no NVML), so no job can be judged.')),
    el('div', { class: 'panel' },
      el('h2', {}, 'Cheaper GPUs that would do (last 30 days)'),
      advice.length ? el('table', { id: 'advice' },
        el('thead', {}, el('tr', {}, ['Job', 'Name', 'Team', 'Runs on', 'Peak GPU memory', 'Util', 'Would fit', 'Saving / month'].map((h) => el('th', {}, h)))),
        el('tbody', {}, advice.map((r) => el('tr', {},
          el('td', {}, el('a', { href: '#/jobs/' + r.id }, r.id)), el('td', {}, r.name), el('td', {}, r.team), el('td', {}, r.model),
          el('td', {}, Math.round(r.peak_gpu_memory_mib) + ' MiB'), el('td', {}, pct(r.util_pct)), el('td', {}, r.instead),
          el('td', {}, money(r.saving_per_month, r.currency))))))
        : el('p', { class: 'muted' }, 'No advice: no sampled job would fit a cheaper model or a MIG slice.')));
}

// Live: the page is read again every 10 s while it is shown, unless the
// user is typing or picking in it.
const LIVE_MS = 10000;
setInterval(() => {
  if (!S.token || document.visibilityState !== 'visible') return;
  const a = document.activeElement;
  if (a && ['INPUT', 'SELECT', 'TEXTAREA'].includes(a.tagName)) return;
  route();
}, LIVE_MS);

window.addEventListener('hashchange', route);
window.addEventListener('DOMContentLoaded', async () => {
  if (!(await finishSignIn())) route();
});
