// The live page of `python -m tinyvllm serve`: it draws each snapshot of the engine that /ui/events sends
// (at most 4 a second), and its form sends prompts to the server's OpenAI routes. A plain script: no
// build step, no library. Text from the server is only ever set as textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
let apiKey = "";   // kept in this page only: a reload asks again, and the key is never stored

// ---- the API key (serve --api-key) ----
// The key goes in the Authorization header, as for the /v1 routes. That is why the events are read with
// fetch rather than EventSource, which cannot send a header: a key in the URL would be kept in the
// browser's history and in any log that records URLs.
function headers(extra = {}) {
  return apiKey ? {...extra, Authorization: `Bearer ${apiKey}`} : extra;
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = $("key").value.trim();
  $("key-form").hidden = true;
});

async function keyGiven() {
  $("key-form").hidden = false;
  while (!$("key-form").hidden) await sleep(200);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// ---- the snapshots ----
async function follow() {
  for (;;) {
    try {
      const response = await fetch("/ui/events", {headers: headers(), cache: "no-store"});
      if (response.status === 401) {
        $("status").textContent = "this server wants an API key (serve --api-key)";
        await keyGiven();
        continue;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      $("status").textContent = "live";
      await readEvents(response.body, draw);
      $("status").textContent = "the stream ended; reconnecting";
    } catch (error) {
      $("status").textContent = `not connected (${error.message}); retrying`;
    }
    await sleep(1000);
  }
}

// Server-sent events by hand: "data: {json}" blocks, each ended by a blank line.
async function readEvents(body, onData) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (event.startsWith("data: ")) onData(JSON.parse(event.slice(6)));
    }
  }
}

function draw(s) {
  $("model").textContent = `${s.model} on ${s.device}`;
  const hits = s.prefix_cache.queries ? (100 * s.prefix_cache.hits / s.prefix_cache.queries).toFixed(0) : 0;
  $("summary").textContent = `step ${s.step} · ${s.running.length} running (at most ${s.max_num_seqs}) · ` +
    `${s.waiting.length} waiting · prefix cache: ${s.prefix_cache.hits} of ${s.prefix_cache.queries} ` +
    `prompt tokens found (${hits}%) · this snapshot took the engine ${s.snapshot_ms.toFixed(2)} ms`;
  drawPool(s);
  drawQueue("running", s.running);
  drawQueue("waiting", s.waiting);
  drawSteps(s);
  drawRates(s);
}

// ---- the pool: a square per block, coloured by the sequence that holds it ----
function drawPool(s) {
  const pool = s.pool, grid = $("grid"), cached = new Set(pool.cached);
  grid.classList.toggle("few", pool.shown <= 64);   // a small pool gets big squares
  while (grid.children.length < pool.shown) grid.append(document.createElement("div"));
  while (grid.children.length > pool.shown) grid.lastChild.remove();
  pool.refs.forEach((refs, b) => {
    const cell = grid.children[b], owner = s.running[pool.owner[b]];
    let kind = "free", title = "free";
    if (refs > 1) {
      [kind, title] = ["shared", `a prefix block shared by ${refs} sequences`];
    } else if (refs === 1) {
      kind = cached.has(b) ? "owned named" : "owned";
      title = `${owner ? owner.id : "?"}` + (cached.has(b) ? ", full: in the prefix cache" : "");
    } else if (cached.has(b)) {
      [kind, title] = ["cached", "cached prefix, unused: kept until a free block is needed"];
    }
    cell.className = `block ${kind}`;
    cell.title = `block ${b}: ${title}`;
    cell.textContent = refs > 1 ? refs : "";
    cell.dataset.owner = refs > 0 && owner ? owner.id : "";
    cell.style.backgroundColor = refs === 1 && owner ? colorOf(owner.id) : "";
  });
  const drawn = pool.shown < pool.num_blocks ? `; the first ${pool.shown} drawn` : "";
  $("pool-summary").textContent = `${pool.num_blocks - pool.free} of ${pool.num_blocks} blocks of ` +
    `${s.block_size} tokens held, ${pool.free} free or evictable${drawn}`;
}

// A request's colour: the next of ten that are easy to tell apart, in the order requests first appear,
// so that requests that arrive together differ (none is grey or white: those mean cached and free).
const PALETTE = ["#7fa7dd", "#f4a65b", "#7cc47c", "#e98080", "#b89ae0", "#c29a87", "#ee9fd0", "#c8c86a",
                 "#7fd3df", "#6fc1a8"];
const colors = new Map();
function colorOf(id) {
  if (colors.size > 1000) colors.clear();   // a page open for days: old requests are long gone
  if (!colors.has(id)) colors.set(id, PALETTE[colors.size % PALETTE.length]);
  return colors.get(id);
}

// "cmpl-4f1c…9a2e-0" -> "9a2e" (sample i > 0 of a request: "9a2e/i")
function label(id) {
  const [, hex, index] = String(id).split("-");
  if (hex === undefined) return String(id);
  return hex.slice(-4) + (index && index !== "0" ? `/${index}` : "");
}

function chip(id, extra = "") {
  const span = document.createElement("span");
  span.className = "chip";
  span.title = String(id);
  span.textContent = label(id);
  span.style.backgroundColor = colorOf(String(id));
  if (extra) {
    const small = document.createElement("small");
    small.textContent = ` ${extra}`;
    span.append(small);
  }
  return span;
}

// ---- the queues ----
function drawQueue(name, seqs) {
  $(`${name}-count`).textContent = `(${seqs.length})`;
  $(name).tBodies[0].replaceChildren(...seqs.map((seq) => {
    const row = document.createElement("tr");
    const cells = [chip(seq.id), seq.prompt, seq.output, seq.computed, seq.cached, seq.blocks, seq.preemptions || ""];
    for (const value of cells) {
      const td = document.createElement("td");
      td.append(value);
      row.append(td);
    }
    if (seq.preemptions) row.lastChild.className = "preempted";
    return row;
  }));
}

// ---- the steps: who prefilled how many tokens, who decoded, who was preempted ----
function drawSteps(s) {
  $("preemptions").textContent = s.preemptions;
  $("steps").replaceChildren(...s.steps.slice().reverse().map((step) => {
    const item = document.createElement("li");
    const number = document.createElement("span");
    number.className = "step-number";
    number.textContent = `step ${step.step}`;
    item.append(number);
    appendRole(item, "prefill", step.prefill.map(([id, tokens]) => chip(id, `+${tokens}`)), step.prefills);
    appendRole(item, "decode", step.decode.map((id) => chip(id)), step.decodes);
    appendRole(item, "preempted", step.preempted.map((id) => chip(id)), step.preempted.length);
    if (step.preempted.length) item.className = "preempted";
    return item;
  }));
}

function appendRole(item, role, chips, count) {
  if (!count) return;
  const name = document.createElement("span");
  name.className = `role ${role}`;
  name.textContent = `${role}:`;
  item.append(name, ...chips);
  if (count > chips.length) item.append(` and ${count - chips.length} more`);
}

// ---- the last minute: tokens per second, time to first token ----
function drawRates(s) {
  const perSecond = s.tokens_per_s, top = Math.max(1, ...perSecond);
  $("tokens-chart").replaceChildren(...perSecond.map((tokens, i) =>
    svg("rect", {x: i + 0.1, y: 30 - 30 * tokens / top, width: 0.8, height: 30 * tokens / top})));
  const mean = perSecond.reduce((a, b) => a + b, 0) / perSecond.length;
  $("tokens-summary").textContent = `output tokens/s, one bar a second: ${perSecond.at(-1)} in the last ` +
    `second, ${mean.toFixed(1)} on average over the minute (highest ${top})`;
  const ttfts = s.ttft_s.map(([, seconds]) => seconds).sort((a, b) => a - b);
  const longest = Math.max(0.001, ...ttfts);
  $("ttft-chart").replaceChildren(...s.ttft_s.map(([ago, seconds]) =>
    svg("rect", {x: 59.7 - ago, y: 30 - 30 * seconds / longest, width: 0.6, height: 30 * seconds / longest})));
  $("ttft-summary").textContent = ttfts.length
    ? `time to first token, a bar per request where its first token came: median ${ttfts[ttfts.length >> 1].toFixed(2)} s, ` +
      `longest ${longest.toFixed(2)} s (${ttfts.length} requests)`
    : "time to first token: no request in the last minute";
}

function svg(tag, attributes) {
  const element = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attributes)) element.setAttribute(name, value);
  return element;
}

// ---- the form: one request, or a burst of N at once (to fill the pool and watch preemption) ----
function requestBody() {
  const text = $("prompt").value;
  const body = {max_tokens: Number($("max-tokens").value), temperature: 0, ignore_eos: $("ignore-eos").checked};
  return $("endpoint").value === "chat" ? {...body, messages: [{role: "user", content: text}]} : {...body, prompt: text};
}

async function post(body) {
  const route = $("endpoint").value === "chat" ? "/v1/chat/completions" : "/v1/completions";
  const response = await fetch(route, {method: "POST", headers: headers({"Content-Type": "application/json"}),
                                       body: JSON.stringify(body)});
  const reply = await response.json();
  if (!response.ok) throw new Error(reply.error ? reply.error.message : `HTTP ${response.status}`);
  return reply;
}

// n sequences at once. A browser opens at most 6 connections to one server and the live stream holds
// one, so n requests would leave 5 at a time: a completion burst is ONE request with n prompts (n
// sequences for the engine, just as n requests); a chat request holds one conversation, so a chat
// burst is n requests, 5 in flight.
async function send(n) {
  const body = requestBody();
  let done = 0, failed = 0;
  const show = () => {
    $("send-status").textContent = `${done} of ${n} done` + (failed ? `, ${failed} failed` : "");
  };
  const one = async (request, count) => {
    try {
      const reply = await post(request);
      reply.choices.forEach((choice) => addReply(reply.id, choice));
      done += count;
    } catch (error) {
      failed += count;
      addError(error.message);
    }
    show();
  };
  show();
  if (n > 1 && body.prompt !== undefined) return one({...body, prompt: Array(n).fill(body.prompt)}, n);
  await Promise.all(Array.from({length: n}, () => one(body, 1)));
}

function addReply(id, choice) {
  const item = document.createElement("li");
  const text = choice.message ? choice.message.content : choice.text;
  item.append(chip(`${id}-${choice.index}`), ` ${choice.finish_reason}: `, text);
  showReply(item);
}

function addError(message) {
  const item = document.createElement("li");
  item.className = "error";
  item.textContent = message;
  showReply(item);
}

function showReply(item) {
  $("replies").prepend(item);
  while ($("replies").children.length > 20) $("replies").lastChild.remove();
}

$("send-form").addEventListener("submit", (event) => {
  event.preventDefault();
  send(1);
});
$("send-burst").addEventListener("click", () => send(Math.max(1, Number($("burst-size").value))));

follow();
