// offgrid's chat page.  Hand-written, no framework, no build step; served with a
// Content-Security-Policy that allows this origin only (server/api/webui.py).
//
// Safety rule: model text, stored text and server messages become DOM text
// nodes (textContent, createTextNode) or checked attribute values, never
// HTML: nothing here assigns innerHTML or outerHTML.  The markdown renderer
// below builds elements directly, so there is nothing to escape and nothing
// to forget to escape.
"use strict";

const STORE = "offgrid.conversations.v1", CURRENT = "offgrid.current", KEY = "offgrid.apiKey";
const TAB = "offgrid.tab", FIM = "offgrid.fim";
// localStorage holds about 5 MB per origin; conversations keep under this many
// characters of JSON and this count, the least recently used dropped first
const MAX_CHARS = 2000000, MAX_CONVERSATIONS = 200;

const $ = (id) => document.getElementById(id);

function el(tag, props, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v == null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const kid of kids) if (kid != null) e.append(kid);     // strings become text nodes
  return e;
}

const fmt = (n, d = 0) => Number(n).toLocaleString("en-US", {maximumFractionDigits: d, minimumFractionDigits: d});

// ---------------------------------------------------------------------------
// Markdown subset -> DOM (paragraphs, headings, lists, quotes, rules, tables,
// fenced code, inline code, emphasis, links).  Everything is text nodes.
// ---------------------------------------------------------------------------

const RE_FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
const RE_HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RE_HR = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const RE_ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const RE_TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function renderMarkdown(src) {
  const frag = document.createDocumentFragment();
  blocks(String(src).replace(/\r\n?/g, "\n").split("\n"), frag, 0);
  return frag;
}

function isFenceClose(line, fence) {
  const t = line.trim();
  return /^ {0,3}\S/.test(line) && t.length >= fence.length && t === fence[0].repeat(t.length);
}

function startsBlock(line, next) {
  return RE_FENCE.test(line) || RE_HEADING.test(line) || RE_HR.test(line) || /^ {0,3}>/.test(line)
    || RE_ITEM.test(line) || (line.includes("|") && next !== undefined && RE_TABLE_SEP.test(next) && next.includes("-"));
}

function blocks(lines, into, depth) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) { i++; continue; }
    if ((m = RE_FENCE.exec(line))) {
      const body = [];
      for (i++; i < lines.length && !isFenceClose(lines[i], m[1]); i++) body.push(lines[i]);
      i++;     // the closing fence (or the end: an answer still streaming)
      into.append(codeBlock(body.join("\n"), m[2]));
    } else if ((m = RE_HEADING.exec(line))) {
      // one level below the page's own heading
      into.append(inline(m[2], el("h" + Math.min(6, m[1].length + 1))));
      i++;
    } else if (RE_HR.test(line)) {
      into.append(el("hr")); i++;
    } else if (/^ {0,3}>/.test(line)) {
      const quoted = [];
      for (; i < lines.length && /^ {0,3}>/.test(lines[i]); i++) quoted.push(lines[i].replace(/^ {0,3}> ?/, ""));
      const q = el("blockquote");
      if (depth < 8) blocks(quoted, q, depth + 1); else q.append(quoted.join("\n"));
      into.append(q);
    } else if (RE_ITEM.test(line)) {
      i = list(lines, i, into, depth);
    } else if (line.includes("|") && i + 1 < lines.length && RE_TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      i = table(lines, i, into);
    } else {
      const para = [line];
      for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines[i], lines[i + 1]); i++) para.push(lines[i]);
      const p = el("p");
      para.forEach((l, k) => { if (k) p.append(el("br")); inline(l.trim(), p); });
      into.append(p);
    }
  }
}

function list(lines, i, into, depth) {
  const first = RE_ITEM.exec(lines[i]);
  const indent = first[1].length, ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.setAttribute("start", parseInt(first[2], 10));
  let item = null;
  while (i < lines.length) {
    const line = lines[i], m = RE_ITEM.exec(line);
    if (m && m[1].length <= indent + 1 && /\d/.test(m[2]) === ordered) {
      item = [m[3]]; node.append(itemNode(item, depth)); i++;
      continue;
    }
    if (!line.trim()) {
      // a blank line ends the list unless the next line is indented under it
      const next = lines[i + 1];
      if (next !== undefined && /^\s+\S/.test(next) && next.search(/\S/) > indent) { item.push(""); i++; continue; }
      break;
    }
    if (line.search(/\S/) > indent) item.push(line.slice(Math.min(line.search(/\S/), indent + 2)));
    else if (!m && !startsBlock(line, lines[i + 1])) item.push(line.trim());    // a lazy continuation
    else break;
    i++;
  }
  // the items' nodes were appended before their lines were complete: fill them now
  node.childNodes.forEach((li) => li._fill());
  into.append(node);
  return i;
}

function itemNode(lines, depth) {
  const li = el("li");
  li._fill = () => {
    const tmp = document.createDocumentFragment();
    if (depth < 8) blocks(lines, tmp, depth + 1); else tmp.append(lines.join("\n"));
    // a tight item is its paragraph's text, not a paragraph
    if (tmp.childNodes.length === 1 && tmp.firstChild.nodeName === "P") li.append(...tmp.firstChild.childNodes);
    else if (tmp.firstChild && tmp.firstChild.nodeName === "P") { li.append(...tmp.firstChild.childNodes); tmp.firstChild.remove(); li.append(tmp); }
    else li.append(tmp);
    delete li._fill;
  };
  return li;
}

function cells(line) {
  let t = line.trim();
  if (t.startsWith("|")) t = t.slice(1);
  if (t.endsWith("|") && !t.endsWith("\\|")) t = t.slice(0, -1);
  return t.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function table(lines, i, into) {
  const head = cells(lines[i]);
  const align = cells(lines[i + 1]).map((c) => (c.endsWith(":") ? (c.startsWith(":") ? "center" : "right") : null));
  const t = el("table"), tr = el("tr");
  const cls = (k) => (align[k] ? "al-" + align[k] : null);
  head.forEach((c, k) => tr.append(inline(c, el("th", {class: cls(k)}))));
  t.append(el("thead", null, tr));
  const body = el("tbody");
  for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) {
    const row = el("tr"), cs = cells(lines[i]);
    head.forEach((_, k) => row.append(inline(cs[k] || "", el("td", {class: cls(k)}))));
    body.append(row);
  }
  t.append(body);
  into.append(t);
  return i;
}

function safeUrl(raw) {
  // the URL parser's reading, not ours: "java\tscript:" is javascript: to it too
  try {
    const u = new URL(raw, location.href);
    return ["http:", "https:", "mailto:"].includes(u.protocol) ? u.href : null;
  } catch (e) {
    return null;
  }
}

function link(href) {
  return el("a", {href, target: "_blank", rel: "noopener noreferrer"});
}

// inline(text, parent): emphasis, code, links and plain text appended to parent
function inline(s, parent, inLink = false, depth = 0) {
  let buf = "";
  const flush = () => { if (buf) { parent.append(buf); buf = ""; } };
  for (let i = 0; i < s.length;) {
    const c = s[i];
    if (c === "\\" && /[!-/:-@[-`{-~]/.test(s[i + 1] || "")) { buf += s[i + 1]; i += 2; continue; }
    if (c === "`") {
      let n = 1;
      while (s[i + n] === "`") n++;
      const tick = "`".repeat(n);
      let close = s.indexOf(tick, i + n);
      while (close >= 0 && s[close + n] === "`") close = s.indexOf(tick, close + n + 1);
      if (close < 0) { buf += tick; i += n; continue; }
      flush();
      let code = s.slice(i + n, close);
      if (/^ .*[^ ].* $/.test(code)) code = code.slice(1, -1);
      parent.append(el("code", {text: code}));
      i = close + n;
      continue;
    }
    if ((c === "*" || c === "_" || c === "~") && depth < 6) {
      let n = 1;
      while (s[i + n] === c && n < 2) n++;
      const mark = c.repeat(n);
      const after = s[i + n] || "";
      const wordBefore = i > 0 && /[\p{L}\p{N}]/u.test(s[i - 1]);
      if (after && !/\s/.test(after) && !(c === "_" && wordBefore) && !(c === "~" && n < 2)) {
        let close = s.indexOf(mark, i + n + 1);
        while (close >= 0 && (/\s/.test(s[close - 1]) || (c === "_" && /[\p{L}\p{N}]/u.test(s[close + n] || "")))) close = s.indexOf(mark, close + 1);
        if (close > i + n) {
          flush();
          const node = el(c === "~" ? "del" : n === 2 ? "strong" : "em");
          inline(s.slice(i + n, close), node, inLink, depth + 1);
          parent.append(node);
          i = close + n;
          continue;
        }
      }
      buf += mark; i += n;
      continue;
    }
    if (c === "[" || (c === "!" && s[i + 1] === "[")) {
      const image = c === "!";
      const m = parseLink(s, image ? i + 1 : i);
      if (m && !inLink) {
        const href = safeUrl(m.url);
        flush();
        if (href) {
          const a = link(href);
          // an image is a link to it: fetching it would be a request to another origin
          if (image) a.append("image: ");
          inline(m.text || m.url, a, true, depth + 1);
          parent.append(a);
        } else {
          buf += s.slice(i, m.end);     // javascript: and friends stay text, as written
        }
        i = m.end;
        continue;
      }
    }
    if (!inLink && c === "h" && !(i > 0 && /\w/.test(s[i - 1]))) {
      const m = /^https?:\/\/[^\s<>"'`]+/.exec(s.slice(i));
      if (m) {
        const url = m[0].replace(/[.,;:!?)\]]+$/, "");
        const href = safeUrl(url);
        if (href) {
          flush();
          const a = link(href);
          a.append(url);
          parent.append(a);
          i += url.length;
          continue;
        }
      }
    }
    buf += c; i++;
  }
  flush();
  return parent;
}

function parseLink(s, i) {
  // [text](url) or [text](url "title"): text may hold balanced brackets
  let depth = 0, j = i;
  for (; j < s.length; j++) {
    if (s[j] === "\\") { j++; continue; }
    if (s[j] === "[") depth++;
    else if (s[j] === "]" && --depth === 0) break;
  }
  if (j >= s.length || s[j + 1] !== "(") return null;
  const m = /^\(\s*<?([^\s()<>]*(?:\([^\s()]*\)[^\s()<>]*)*)>?(?:\s+"[^"]*")?\s*\)/.exec(s.slice(j + 1));
  if (!m) return null;
  return {text: s.slice(i + 1, j), url: m[1], end: j + 1 + m[0].length};
}

// -- code blocks: a copy button and a small keyword highlighter -----------------

const KEYWORDS = new Set(("abstract and as assert async await break case catch class const continue def default defer " +
  "del delete do elif else enum except export extends false final finally fn for from func function go if impl " +
  "import in instanceof interface is lambda let loop match mod mut new nil none null not or package pass pub raise " +
  "return self static struct super switch this throw throws true try type typeof use var void where while with yield " +
  "int float double char bool string str long unsigned signed echo fi then done esac local").split(" "));
const NO_HASH_COMMENT = /^(c|h|cpp|c\+\+|cc|hpp|cs|csharp|java|js|javascript|jsx|ts|typescript|tsx|go|rust|rs|json|css|swift|kotlin|kt|scala|php|dart)$/i;
const NO_SLASH_COMMENT = /^(py|python|sh|bash|shell|zsh|console|ruby|rb|yaml|yml|toml|ini|r|perl|pl|make|makefile|dockerfile|text|txt|)$/i;

function highlight(code, lang, into) {
  const parts = ["\"\"\"[\\s\\S]*?\"\"\"", "'''[\\s\\S]*?'''", "\"(?:[^\"\\\\\\n]|\\\\.)*\"", "'(?:[^'\\\\\\n]|\\\\.)*'", "`(?:[^`\\\\]|\\\\.)*`",
    "\\b\\d[\\d_]*(?:\\.\\d+)?(?:[eE][+-]?\\d+)?\\b", "\\b[A-Za-z_]\\w*\\b"];
  if (!NO_HASH_COMMENT.test(lang)) parts.unshift("#[^\\n]*");
  if (!NO_SLASH_COMMENT.test(lang)) parts.unshift("//[^\\n]*", "/\\*[\\s\\S]*?\\*/");
  const re = new RegExp(parts.join("|"), "g");
  let last = 0, m;
  while ((m = re.exec(code))) {
    const t = m[0];
    let cls = null;
    if (t.startsWith("#") || t.startsWith("//") || t.startsWith("/*")) cls = "tok-com";
    else if (/^["'`]/.test(t)) cls = "tok-str";
    else if (/^\d/.test(t)) cls = "tok-num";
    else if (KEYWORDS.has(t) || KEYWORDS.has(t.toLowerCase()) && /^(True|False|None)$/.test(t)) cls = "tok-kw";
    if (!cls) continue;
    if (m.index > last) into.append(code.slice(last, m.index));
    into.append(el("span", {class: cls, text: t}));
    last = m.index + t.length;
  }
  if (last < code.length) into.append(code.slice(last));
  return into;
}

function codeBlock(code, lang) {
  const pre = el("pre"), c = el("code");
  if (code.length < 60000) highlight(code, lang, c); else c.textContent = code;
  pre.append(c);
  const copy = el("button", {type: "button", class: "link", text: "Copy", "aria-label": "Copy code"});
  copy.addEventListener("click", () => copyText(code, copy));
  return el("div", {class: "codeblock"}, el("div", {class: "bar"}, el("span", {text: lang || "code"}), copy), pre);
}

function copyText(text, button) {
  const done = () => { button.textContent = "Copied"; setTimeout(() => (button.textContent = "Copy"), 1500); };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(done, () => fallbackCopy(text) && done());
  } else if (fallbackCopy(text)) done();
}

function fallbackCopy(text) {
  // a page on a LAN address over http has no clipboard API
  const t = el("textarea", {class: "sr", "aria-hidden": "true"});
  t.value = text;
  document.body.append(t);
  t.select();
  let ok = false;
  try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
  t.remove();
  return ok;
}

// ---------------------------------------------------------------------------
// Storage: conversations, bounded
// ---------------------------------------------------------------------------

const SETTINGS = ["system", "temperature", "max_tokens", "top_p", "seed"];

function newConversation() {
  const now = Date.now();
  return {id: "c" + now.toString(36) + Math.random().toString(36).slice(2, 7), title: "New chat",
    created: now, updated: now, model: null, settings: {}, messages: [], used: null};
}

// whatever the storage or an import holds, a conversation of plain strings and numbers
function normalize(c) {
  if (!c || typeof c !== "object") return null;
  const out = newConversation();
  if (typeof c.id === "string" && c.id) out.id = c.id.slice(0, 64);
  out.title = typeof c.title === "string" && c.title.trim() ? c.title.slice(0, 200) : "Untitled";
  for (const k of ["created", "updated", "used"]) if (Number.isFinite(c[k])) out[k] = c[k];
  if (typeof c.model === "string") out.model = c.model;
  const s = c.settings && typeof c.settings === "object" ? c.settings : {};
  for (const k of SETTINGS) {
    if (k === "system" ? typeof s[k] === "string" : Number.isFinite(s[k])) out.settings[k] = s[k];
  }
  out.messages = (Array.isArray(c.messages) ? c.messages : []).filter((m) => m && (m.role === "user" || m.role === "assistant"))
    .map((m) => {
      const msg = {role: m.role, content: typeof m.content === "string" ? m.content : String(m.content == null ? "" : m.content)};
      if (m.role === "user" && Array.isArray(m.images)) {
        const imgs = m.images.filter((u) => typeof u === "string" && /^data:image\/[a-z0-9.+-]+;base64,[A-Za-z0-9+/=]+$/i.test(u));
        if (imgs.length) msg.images = imgs.slice(0, 16);
      }
      if (typeof m.reasoning === "string" && m.reasoning) msg.reasoning = m.reasoning;
      if (typeof m.error === "string" && m.error) msg.error = m.error;
      if (typeof m.model === "string") msg.model = m.model;
      if (m.stopped === true) msg.stopped = true;
      if (m.stats && typeof m.stats === "object") {
        msg.stats = {};
        for (const [k, v] of Object.entries(m.stats)) if (Number.isFinite(v) || typeof v === "string") msg.stats[k] = v;
      }
      return msg;
    });
  return out;
}

const state = {conversations: [], current: null, models: [], busy: null, pendingLoad: null, tab: "chat"};

function loadStore() {
  let list = [];
  try { list = JSON.parse(localStorage.getItem(STORE) || "[]"); } catch (e) { list = []; }
  state.conversations = (Array.isArray(list) ? list : []).map(normalize).filter(Boolean);
  const seen = new Set();
  state.conversations = state.conversations.filter((c) => !seen.has(c.id) && seen.add(c.id));
  const cur = localStorage.getItem(CURRENT);
  state.current = state.conversations.find((c) => c.id === cur) || state.conversations[0] || null;
  if (!state.current) { state.current = newConversation(); state.conversations.push(state.current); }
}

function save() {
  const cur = state.current;
  // most recent first; the oldest go while the whole is too large
  const list = state.conversations.slice().sort((a, b) => b.updated - a.updated);
  let dropped = 0;
  for (;;) {
    const json = JSON.stringify(list);
    let fits = json.length <= MAX_CHARS && list.length <= MAX_CONVERSATIONS;
    if (fits) {
      try { localStorage.setItem(STORE, json); } catch (e) { fits = false; }      // the browser's quota
    }
    if (fits || list.length <= 1) break;
    const victim = list.reduce((o, c) => (c !== cur && (!o || c.updated < o.updated) ? c : o), null);
    if (!victim) break;
    list.splice(list.indexOf(victim), 1);
    dropped++;
  }
  if (dropped) {
    state.conversations = state.conversations.filter((c) => list.includes(c));
    $("storage-note").textContent = dropped + " old conversation" + (dropped > 1 ? "s" : "") + " dropped to stay within the browser's storage.";
    renderList();
  }
  if (cur) localStorage.setItem(CURRENT, cur.id);
}

// ---------------------------------------------------------------------------
// The server: requests with the API key, the key dialog on a 401
// ---------------------------------------------------------------------------

let keyPrompt = null;

async function api(path, opts = {}) {
  for (;;) {
    const headers = {};
    if (opts.json !== undefined) headers["Content-Type"] = "application/json";
    const key = localStorage.getItem(KEY);
    if (key) headers.Authorization = "Bearer " + key;
    // relative to the page: with --api-prefix the page is at PREFIX/, and the API under it
    const res = await fetch("." + path, {method: opts.json !== undefined ? "POST" : "GET", headers, cache: "no-store",
      body: opts.json !== undefined ? JSON.stringify(opts.json) : undefined, signal: opts.signal});
    if (res.status !== 401) return res;
    const why = await errorText(res);
    if (!(await askKey(key ? why : ""))) return res;
  }
}

function askKey(error) {
  $("open-key").hidden = false;     // a server with a key: the key can be changed later
  if (!keyPrompt) {
    keyPrompt = new Promise((resolve) => {
      const d = $("key-dialog");
      $("key-error").textContent = error ? "The server said: " + error : "";
      $("key-input").value = "";
      const finish = (ok) => {
        d.removeEventListener("close", onClose);
        if (d.open) d.close();
        keyPrompt = null;
        resolve(ok);
      };
      const onClose = () => finish(false);
      d.addEventListener("close", onClose);
      $("key-form").onsubmit = (e) => {
        e.preventDefault();
        const v = $("key-input").value.trim();
        if (v) localStorage.setItem(KEY, v); else localStorage.removeItem(KEY);
        finish(true);
      };
      $("key-cancel").onclick = () => finish(false);
      d.showModal();
      $("key-input").focus();
    });
  }
  return keyPrompt;
}

async function errorText(res) {
  let text = "";
  try { text = await res.text(); } catch (e) { /* the body went away */ }
  let msg = text;
  try {
    const j = JSON.parse(text);
    msg = (j.error && (j.error.message || (typeof j.error === "string" && j.error))) || j.message || text;
  } catch (e) { /* not JSON: the text as it is */ }
  return res.status + " " + (res.statusText || "") + (msg ? ": " + String(msg).slice(0, 2000) : "");
}

// ---------------------------------------------------------------------------
// Models: the shelf's status, the picker
// ---------------------------------------------------------------------------

let modelTimer = null;

async function refreshModels() {
  clearTimeout(modelTimer);
  try {
    const res = await api("/v1/models");
    if (res.ok) {
      const j = await res.json();
      state.models = (j.data || []).filter((m) => m && typeof m.id === "string");
      renderModels();
    } else {
      setModelState(await errorText(res), true);
    }
  } catch (e) {
    setModelState("server unreachable", true);
  }
  const loading = state.models.some((m) => statusOf(m) === "loading") || state.pendingLoad || state.busy;
  modelTimer = setTimeout(refreshModels, loading ? 1000 : 15000);
}

const statusOf = (m) => (m.status && m.status.value) || "loaded";
const capsOf = (m) => (Array.isArray(m.capabilities) ? m.capabilities : null);     // null: not known yet
const chatOk = (m) => !capsOf(m) || capsOf(m).includes("chat");
const fimOk = (m) => !capsOf(m) || capsOf(m).includes("infill");

function describe(m) {
  const st = statusOf(m);
  if (st === "loading") {
    const p = m.status.progress && m.status.progress.value;
    return "loading" + (Number.isFinite(p) ? " " + Math.round(p * 100) + "%" : "");
  }
  return {loaded: "loaded", unloaded: "not loaded", sleeping: "asleep", error: "cannot load"}[st] || st;
}

function usable(m) {
  return state.tab === "code" ? fimOk(m) : chatOk(m);
}

function selectedModelId() {
  if (state.tab === "code") return localStorage.getItem(FIM + ".model");
  return state.current && state.current.model;
}

let shownModels = "";

function renderModels() {
  const sel = $("model");
  const want = selectedModelId();
  const options = state.models.map((m) => {
    const caps = capsOf(m);
    let note = "";
    if (caps && !caps.includes("chat")) note = caps.includes("infill") ? " \u2014 code completion only" : " \u2014 embeddings only";
    else if (state.tab === "code" && caps && !caps.includes("infill")) note = " \u2014 no fill-in-the-middle";
    return [m.id, !usable(m), m.id.replace(/\.gguf$/i, "") + " (" + describe(m) + ")" + note];
  });
  // rebuilt only when something changed: a rebuild would close the list under the pointer
  const sig = JSON.stringify(options);
  if (sig !== shownModels || !sel.options.length) {
    shownModels = sig;
    sel.replaceChildren(...options.map(([value, disabled, text]) => el("option", {value, disabled, text})));
  }
  let pick = state.models.find((m) => m.id === want && usable(m));
  if (!pick) pick = state.models.find((m) => usable(m) && statusOf(m) === "loaded") || state.models.find(usable);
  if (pick) {
    sel.value = pick.id;
    if (state.tab === "chat" && state.current && state.current.model !== pick.id && !state.current.messages.length) state.current.model = pick.id;
  }
  if (!state.models.length && !sel.options.length) sel.append(el("option", {value: "", text: "no models"}));
  const m = pick, st = m && statusOf(m), pending = state.pendingLoad;
  // a load asked for is followed closely until it ends (its thread may not have begun yet)
  if (pending && (!m || pending.id !== m.id || st === "loaded" || st === "error" ||
      (st !== "loading" && Date.now() - pending.since > 5000))) state.pendingLoad = null;
  const why = st === "error" && m.status.error ? ": " + m.status.error : "";
  setModelState(m ? describe(m) + why : "", st === "error", st === "loading");
  updateContext();
  updateAttach();
}

function setModelState(text, error, loading) {
  const s = $("model-state");
  s.textContent = text;
  s.className = "model-state" + (loading ? " loading" : "") + (error ? " error-text" : "");
}

function currentModel() {
  const id = $("model").value;
  return state.models.find((m) => m.id === id) || null;
}

async function pickModel() {
  const id = $("model").value;
  if (state.tab === "code") localStorage.setItem(FIM + ".model", id);
  else if (state.current) { state.current.model = id; save(); }
  const m = currentModel();
  if (m && (statusOf(m) === "unloaded" || statusOf(m) === "sleeping")) {
    // load it now, so the first message need not wait for it (the status shows progress)
    state.pendingLoad = {id, since: Date.now()};
    setModelState("loading", false, true);
    const res = await api("/models/load", {json: {model: id}});
    if (!res.ok && res.status !== 400) setModelState(await errorText(res), true);
  }
  refreshModels();
}

// ---------------------------------------------------------------------------
// Conversations: the list, switching, renaming, export and import
// ---------------------------------------------------------------------------

function renderList() {
  const ul = $("conversations");
  ul.replaceChildren();
  const list = state.conversations.slice().sort((a, b) => b.updated - a.updated);
  for (const c of list) {
    const current = c === state.current;
    const open = el("button", {type: "button", class: "conv-open", title: c.title, text: c.title, "aria-current": current ? "true" : null,
      onclick: () => switchTo(c)});
    const rename = el("button", {type: "button", class: "link", "aria-label": "Rename " + c.title, title: "Rename", text: "\u270E",
      onclick: () => startRename(c, li)});
    const del = el("button", {type: "button", class: "link", "aria-label": "Delete " + c.title, title: "Delete", text: "\u2715",
      onclick: () => remove(c)});
    const li = el("li", {class: current ? "current" : null}, open, rename, del);
    ul.append(li);
  }
}

function startRename(c, li) {
  const input = el("input", {type: "text", "aria-label": "New name", value: c.title});
  let done = false;       // Enter or Escape, then the blur of the input going away
  const commit = (keep) => {
    if (done) return;
    done = true;
    if (keep && input.value.trim()) { c.title = input.value.trim().slice(0, 200); save(); }
    renderList();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") { e.preventDefault(); commit(true); }
    if (e.key === "Escape") { e.preventDefault(); commit(false); }
  });
  input.addEventListener("blur", () => commit(true));
  li.replaceChildren(input);
  input.focus();
  input.select();
}

function switchTo(c) {
  state.current = c;
  localStorage.setItem(CURRENT, c.id);
  renderList();
  renderChat();
  renderSettings();
  renderModels();
  $("side").classList.remove("open");
  $("toggle-side").setAttribute("aria-expanded", "false");
  $("prompt").focus();
}

function remove(c) {
  if (state.busy && state.busy.conv === c) state.busy.ctl.abort();
  state.conversations = state.conversations.filter((x) => x !== c);
  if (state.current === c) {
    state.current = state.conversations.slice().sort((a, b) => b.updated - a.updated)[0] || null;
    if (!state.current) { state.current = newConversation(); state.conversations.push(state.current); }
  }
  save();
  switchTo(state.current);
}

function newChat() {
  const empty = state.conversations.find((c) => !c.messages.length);
  const c = empty || newConversation();
  if (!empty) {
    const prev = state.current;
    c.model = prev && prev.model;
    c.settings = Object.assign({}, prev ? prev.settings : {});
    state.conversations.push(c);
  }
  c.updated = Date.now();
  save();
  switchTo(c);
}

function exportAll() {
  const blob = new Blob([JSON.stringify({format: "offgrid-conversations", version: 1, conversations: state.conversations}, null, 1)],
    {type: "application/json"});
  const a = el("a", {href: URL.createObjectURL(blob), download: "offgrid-conversations-" + new Date().toISOString().slice(0, 10) + ".json"});
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 5000);
}

function importFile(file) {
  const r = new FileReader();
  r.onload = () => {
    let list;
    try {
      const j = JSON.parse(String(r.result));
      list = Array.isArray(j) ? j : j && Array.isArray(j.conversations) ? j.conversations : null;
    } catch (e) { list = null; }
    if (!list) { $("storage-note").textContent = "That file holds no conversations."; return; }
    const ids = new Set(state.conversations.map((c) => c.id));
    let n = 0;
    for (const raw of list) {
      const c = normalize(raw);
      if (!c) continue;
      if (ids.has(c.id)) c.id = newConversation().id;
      ids.add(c.id);
      state.conversations.push(c);
      n++;
    }
    $("storage-note").textContent = "Imported " + n + " conversation" + (n === 1 ? "" : "s") + ".";
    save();
    renderList();
  };
  r.readAsText(file);
}

// ---------------------------------------------------------------------------
// Settings of the conversation
// ---------------------------------------------------------------------------

function renderSettings() {
  const s = state.current.settings;
  for (const k of SETTINGS) $("set-" + k).value = s[k] == null ? "" : s[k];
}

function readSetting(k) {
  const v = $("set-" + k).value;
  const s = state.current.settings;
  if (k === "system") { if (v.trim()) s.system = v; else delete s.system; }
  else if (v === "" || !Number.isFinite(Number(v))) delete s[k];
  else s[k] = k === "temperature" || k === "top_p" ? Number(v) : Math.trunc(Number(v));
  save();
}

// ---------------------------------------------------------------------------
// Chat: rendering, sending, streaming, stop, regenerate, edit
// ---------------------------------------------------------------------------

function renderChat() {
  const box = $("messages");
  box.replaceChildren();
  const c = state.current;
  c.messages.forEach((m, i) => box.append(messageNode(c, m, i)));
  $("empty").hidden = c.messages.length > 0;
  updateBusy();
  updateContext();
  box.scrollTop = box.scrollHeight;
}

function messageNode(c, m, i) {
  const mine = m.role === "user";
  const node = el("div", {class: "msg " + m.role, "aria-label": mine ? "You" : "Assistant"});
  node.append(el("div", {class: "who", text: mine ? "You" : (m.model || "Assistant").replace(/\.gguf$/i, "")}));
  const bubble = el("div", {class: "bubble"});
  fillBubble(bubble, m, state.busy && state.busy.msg === m);
  node.append(bubble);
  const tools = el("div", {class: "tools"});
  if (m.role === "assistant" && m.stats) tools.append(el("span", {class: "stats", text: statsText(m)}));
  else if (m.stopped) tools.append(el("span", {class: "stats", text: "stopped"}));
  if (m.content) tools.append(el("button", {type: "button", class: "link", text: "Copy", onclick: (e) => copyText(m.content, e.target)}));
  const last = i === c.messages.length - 1;
  if (!state.busy) {
    if (mine) tools.append(el("button", {type: "button", class: "link", text: "Edit", "aria-label": "Edit and resend this message",
      onclick: () => startEdit(c, i, node)}));
    if (!mine && last) tools.append(el("button", {type: "button", class: "link regenerate", text: "Regenerate",
      onclick: () => regenerate(c)}));
  }
  node.append(tools);
  return node;
}

function fillBubble(bubble, m, live) {
  bubble.replaceChildren();
  if (m.role === "user") {
    bubble.textContent = m.content;
    (m.images || []).forEach((u, i) => bubble.append(el("img", {class: "attached-image", src: u, alt: "image " + (i + 1)})));
    return;
  }
  if (m.reasoning) {
    const d = el("details", {class: "reasoning"}, el("summary", {text: live && !m.content ? "Thinking\u2026" : "Reasoning"}),
      el("div", {class: "thought", text: m.reasoning}));
    bubble.append(d);
  }
  if (m.progress && !m.content && !m.reasoning) bubble.append(el("p", {class: "progress", text: m.progress}));
  if (m.content) bubble.append(renderMarkdown(m.content));
  if (m.error) bubble.append(el("div", {class: "error-box", role: "alert", text: m.error}));
  if (live) {
    const tail = bubble.lastElementChild && !bubble.lastElementChild.matches(".reasoning, .codeblock") ? bubble.lastElementChild : null;
    if (tail) tail.classList.add("typing"); else bubble.append(el("p", {class: "typing progress"}));
  }
  bubble.setAttribute("aria-busy", live ? "true" : "false");
}

function statsText(m) {
  const s = m.stats, out = [];
  if (Number.isFinite(s.predicted_n)) out.push(fmt(s.predicted_n) + " tokens");
  if (Number.isFinite(s.predicted_per_second) && s.predicted_n > 1) out.push(fmt(s.predicted_per_second, 1) + " tok/s");
  if (Number.isFinite(s.prompt_n)) {
    let p = "prompt " + fmt(s.prompt_n) + " tokens";
    if (Number.isFinite(s.prompt_ms)) p += " in " + fmt(s.prompt_ms) + " ms";
    if (s.cache_n > 0) p += " (" + fmt(s.cache_n) + " cached)";
    out.push(p);
  }
  if (m.stopped) out.push("stopped");
  else if (s.finish === "length") out.push("cut at the token limit");
  return out.join(" \u00b7 ");
}

function updateContext() {
  const m = currentModel();
  const nctx = m && ((m.settings && m.settings.n_ctx) || (m.meta && m.meta.n_ctx));
  const used = state.current && state.current.used;
  const meter = $("ctx-meter");
  if (nctx && used != null) {
    meter.max = nctx; meter.value = Math.min(used, nctx);
    $("ctx-text").textContent = fmt(used) + " of " + fmt(nctx) + " tokens (" + Math.round((100 * used) / nctx) + "%)";
  } else {
    meter.value = 0;
    $("ctx-text").textContent = nctx ? "0 of " + fmt(nctx) + " tokens" : "";
  }
}

function updateBusy() {
  const busy = !!state.busy;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function apiMessages(c, upto) {
  const out = [];
  if (c.settings.system) out.push({role: "system", content: c.settings.system});
  for (const m of c.messages.slice(0, upto)) {
    if (m.role === "assistant" && !m.content) continue;    // an error or an empty stop
    const images = m.role === "user" && m.images ? m.images : [];
    // an image goes as OpenAI's image_url part, after the text it came with
    out.push({role: m.role, content: images.length ? [{type: "text", text: m.content}].concat(
      images.map((url) => ({type: "image_url", image_url: {url}}))) : m.content});
  }
  return out;
}

function sendPrompt() {
  const text = $("prompt").value;
  if ((!text.trim() && !attached.length) || state.busy) return;
  const c = state.current;
  const msg = {role: "user", content: text};
  if (attached.length) msg.images = attached;
  c.messages.push(msg);
  if (c.title === "New chat" || !c.title) c.title = text.trim().split("\n")[0].slice(0, 60) || "Image";
  $("prompt").value = "";
  attached = [];
  renderAttached();
  generate(c);
}

// ---------------------------------------------------------------------------
// Images: attached or pasted when the chosen model takes them (its /v1/models
// input_modalities name "image", an mmproj's), sent as image_url parts and kept
// with the conversation as data: URIs, each drawn smaller where it is larger
// than IMAGE_MAX_CHARS, so that a picture leaves room in the stored bound
// ---------------------------------------------------------------------------

const IMAGE_MAX_CHARS = 300000, IMAGE_MAX_SIDE = 1024;
let attached = [];      // data: URIs for the next message

const visionOk = (m) => !!(m && m.architecture && Array.isArray(m.architecture.input_modalities) &&
  m.architecture.input_modalities.includes("image"));

function updateAttach() {
  const ok = state.tab === "chat" && visionOk(state.models.find((m) => m.id === $("model").value));
  $("attach-label").hidden = !ok;
  if (!ok && attached.length) { attached = []; renderAttached(); }
}

function renderAttached() {
  $("attached").replaceChildren(...attached.map((u, i) => el("span", {class: "thumb"},
    el("img", {src: u, alt: "attached image " + (i + 1)}),
    el("button", {type: "button", class: "remove", text: "\u00d7", "aria-label": "Remove image " + (i + 1),
      onclick: () => { attached.splice(i, 1); renderAttached(); }}))));
}

function attachFile(file) {
  if (!file || !/^image\//.test(file.type) || attached.length >= 16) return;
  const r = new FileReader();
  r.onload = () => fitImage(String(r.result)).then((u) => { if (u) { attached.push(u); renderAttached(); } });
  r.readAsDataURL(file);
}

// small enough: as it is (its own bytes and format); larger: drawn smaller, as a JPEG
function fitImage(uri) {
  if (uri.length <= IMAGE_MAX_CHARS) return Promise.resolve(uri);
  return new Promise((resolve) => {
    const img = new Image();
    img.onload = () => {
      let k = Math.min(1, IMAGE_MAX_SIDE / Math.max(img.width, img.height, 1));
      for (;;) {
        const cv = document.createElement("canvas");
        cv.width = Math.max(1, Math.round(img.width * k));
        cv.height = Math.max(1, Math.round(img.height * k));
        cv.getContext("2d").drawImage(img, 0, 0, cv.width, cv.height);
        const out = cv.toDataURL("image/jpeg", 0.85);
        if (out.length <= IMAGE_MAX_CHARS || cv.width <= 16) { resolve(out); return; }
        k *= 0.7;
      }
    };
    img.onerror = () => resolve(null);
    img.src = uri;
  });
}

function regenerate(c) {
  if (state.busy) return;
  if (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
  generate(c);
}

function startEdit(c, i, node) {
  const box = el("textarea", {rows: 3, "aria-label": "Edit your message"});
  box.value = c.messages[i].content;
  const go = () => {
    if (!box.value.trim() || state.busy) return;
    const images = c.messages[i].images;
    c.messages = c.messages.slice(0, i);
    c.messages.push(images ? {role: "user", content: box.value, images} : {role: "user", content: box.value});
    generate(c);
  };
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); go(); }
    if (e.key === "Escape") renderChat();
  });
  const wrap = el("div", {class: "edit-box"}, box, el("div", {class: "row"},
    el("button", {type: "button", text: "Cancel", onclick: renderChat}),
    el("button", {type: "button", class: "primary", text: "Send", onclick: go})));
  node.replaceChildren(node.firstChild, wrap);
  box.focus();
}

async function generate(c) {
  const model = state.models.length ? $("model").value || c.model : c.model;
  c.model = model || c.model;
  const msg = {role: "assistant", content: "", model: c.model || undefined};
  c.messages.push(msg);
  c.updated = Date.now();
  const ctl = new AbortController();
  state.busy = {conv: c, msg, ctl};
  save();
  renderList();
  renderChat();
  refreshModels();
  const body = {messages: apiMessages(c, c.messages.length - 1), stream: true, stream_options: {include_usage: true}, return_progress: true};
  if (c.model) body.model = c.model;
  for (const k of SETTINGS) if (k !== "system" && c.settings[k] != null) body[k] = c.settings[k];
  let node = $("messages").lastElementChild, queued = false;
  const paint = () => {
    queued = false;
    if (state.current !== c || !node) return;
    const box = $("messages");
    const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
    fillBubble(node.querySelector(".bubble"), msg, state.busy && state.busy.msg === msg);
    if (atEnd) box.scrollTop = box.scrollHeight;
  };
  // at most one paint per 60 ms: a long answer is parsed again at each, and the
  // browser should not take the cores the model is generating on
  const repaint = () => { if (!queued) { queued = true; setTimeout(() => requestAnimationFrame(paint), 60); } };
  msg.progress = "Waiting for the model\u2026";
  repaint();
  try {
    const res = await api("/v1/chat/completions", {json: body, signal: ctl.signal});
    if (!res.ok) msg.error = await errorText(res);
    else await readStream(res, msg, c, repaint);
  } catch (e) {
    if (e.name === "AbortError") msg.stopped = true;
    else msg.error = "The connection failed: " + e.message;
  }
  delete msg.progress;
  state.busy = null;
  c.updated = Date.now();
  save();
  if (state.current === c) renderChat();
  refreshModels();
  if (state.current === c) $("prompt").focus();
}

async function readStream(res, msg, c, repaint) {
  const reader = res.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += dec.decode(value, {stream: true}).replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data || data === "[DONE]") continue;
      let j;
      try { j = JSON.parse(data); } catch (e) { continue; }
      chunk(j, msg, c);
      repaint();
    }
  }
}

function chunk(j, msg, c) {
  if (j.error) { msg.error = (j.error.message || JSON.stringify(j.error)); return; }
  if (typeof j.model === "string") msg.model = j.model;     // the server's word for who answered
  if (j.prompt_progress) {
    const p = j.prompt_progress;
    msg.progress = p.total ? "Reading the prompt: " + Math.round((100 * p.processed) / p.total) + "%" : msg.progress;
  }
  const ch = (j.choices || [])[0];
  if (ch) {
    const d = ch.delta || {};
    if (typeof d.reasoning_content === "string") msg.reasoning = (msg.reasoning || "") + d.reasoning_content;
    if (typeof d.content === "string") msg.content += d.content;
    if (ch.finish_reason) msg.finish = ch.finish_reason;
  }
  if (j.timings || j.usage) {
    const t = j.timings || {}, u = j.usage || {};
    msg.stats = {predicted_n: t.predicted_n != null ? t.predicted_n : u.completion_tokens,
      predicted_per_second: t.predicted_per_second, prompt_n: t.prompt_n != null ? t.prompt_n + (t.cache_n || 0) : u.prompt_tokens,
      prompt_ms: t.prompt_ms, cache_n: t.cache_n, finish: msg.finish};
    for (const k of Object.keys(msg.stats)) if (msg.stats[k] == null) delete msg.stats[k];
    if (Number.isFinite(u.total_tokens)) c.used = u.total_tokens;
  }
}

// ---------------------------------------------------------------------------
// Code completion: /infill with a prefix and a suffix
// ---------------------------------------------------------------------------

let fimCtl = null;

async function complete() {
  if (fimCtl) return;
  const out = $("fim-result"), stats = $("fim-stats");
  out.textContent = "";
  stats.textContent = "working\u2026";
  const body = {input_prefix: $("fim-prefix").value, input_suffix: $("fim-suffix").value,
    n_predict: Math.max(1, parseInt($("fim-n").value, 10) || 64), temperature: 0};
  const m = $("model").value;
  if (m) body.model = m;
  localStorage.setItem(FIM, JSON.stringify({prefix: body.input_prefix, suffix: body.input_suffix}));
  fimCtl = new AbortController();
  $("fim-go").hidden = true;
  $("fim-stop").hidden = false;
  try {
    const res = await api("/infill", {json: body, signal: fimCtl.signal});
    if (!res.ok) { stats.textContent = ""; out.append(el("span", {class: "error-text", text: await errorText(res)})); }
    else {
      const j = await res.json();
      out.textContent = typeof j.content === "string" ? j.content : "";
      const t = j.timings || {};
      const parts = [fmt(j.tokens_predicted || 0) + " tokens"];
      if (Number.isFinite(t.predicted_per_second)) parts.push(fmt(t.predicted_per_second, 1) + " tok/s");
      if (Number.isFinite(t.prompt_ms)) parts.push("prompt " + fmt(t.prompt_n || j.tokens_evaluated || 0) + " tokens in " + fmt(t.prompt_ms) + " ms");
      if (j.model) parts.push(j.model);
      stats.textContent = parts.join(" \u00b7 ");
    }
  } catch (e) {
    stats.textContent = e.name === "AbortError" ? "stopped" : "The connection failed: " + e.message;
  }
  fimCtl = null;
  $("fim-go").hidden = false;
  $("fim-stop").hidden = true;
  refreshModels();
}

// ---------------------------------------------------------------------------
// Tabs, keys, start
// ---------------------------------------------------------------------------

function showTab(name, focus) {
  state.tab = name;
  localStorage.setItem(TAB, name);
  for (const t of ["chat", "code"]) {
    const tab = $("tab-" + t), on = t === name;
    tab.setAttribute("aria-selected", on ? "true" : "false");
    tab.tabIndex = on ? 0 : -1;
    $("view-" + t).hidden = !on;
  }
  $("side").hidden = name !== "chat";
  $("toggle-side").hidden = name !== "chat";
  if (focus) $("tab-" + name).focus();
  renderModels();
}

function init() {
  $("open-key").hidden = !localStorage.getItem(KEY);
  loadStore();
  save();
  const fim = (() => { try { return JSON.parse(localStorage.getItem(FIM) || "{}") || {}; } catch (e) { return {}; } })();
  $("fim-prefix").value = typeof fim.prefix === "string" ? fim.prefix : "def fib(n):\n    ";
  $("fim-suffix").value = typeof fim.suffix === "string" ? fim.suffix : "\n\nprint(fib(10))\n";

  $("composer").addEventListener("submit", (e) => { e.preventDefault(); sendPrompt(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); sendPrompt(); }
  });
  $("stop").addEventListener("click", () => state.busy && state.busy.ctl.abort());
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.busy && !$("key-dialog").open) state.busy.ctl.abort();
  });
  $("model").addEventListener("change", pickModel);
  $("model").addEventListener("change", updateAttach);
  $("attach").addEventListener("change", (e) => { [...e.target.files].forEach(attachFile); e.target.value = ""; });
  $("prompt").addEventListener("paste", (e) => {
    const files = [...((e.clipboardData && e.clipboardData.files) || [])].filter((f) => /^image\//.test(f.type));
    if (files.length && !$("attach-label").hidden) { e.preventDefault(); files.forEach(attachFile); }
  });
  $("new-chat").addEventListener("click", newChat);
  $("export").addEventListener("click", exportAll);
  $("import-file").addEventListener("change", (e) => { if (e.target.files[0]) importFile(e.target.files[0]); e.target.value = ""; });
  for (const k of SETTINGS) $("set-" + k).addEventListener("change", () => readSetting(k));
  $("open-key").addEventListener("click", () => askKey("").then((ok) => ok && refreshModels()));
  $("toggle-side").addEventListener("click", () => {
    const open = $("side").classList.toggle("open");
    $("toggle-side").setAttribute("aria-expanded", open ? "true" : "false");
    if (open) $("new-chat").focus();
  });
  for (const t of ["chat", "code"]) $("tab-" + t).addEventListener("click", () => showTab(t));
  $("tab-chat").parentElement.addEventListener("keydown", (e) => {
    if (e.key === "ArrowRight" || e.key === "ArrowLeft") showTab(state.tab === "chat" ? "code" : "chat", true);
  });
  $("fim-go").addEventListener("click", complete);
  $("fim-stop").addEventListener("click", () => fimCtl && fimCtl.abort());
  for (const id of ["fim-prefix", "fim-suffix"]) {
    $(id).addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); complete(); } });
  }
  // other tabs of this page write the same storage: take their changes
  window.addEventListener("storage", (e) => {
    if (e.key === STORE && !state.busy) { const id = state.current.id; loadStore(); state.current = state.conversations.find((c) => c.id === id) || state.current; renderList(); renderChat(); }
  });

  renderList();
  renderSettings();
  showTab(localStorage.getItem(TAB) === "code" ? "code" : "chat");
  renderChat();
  refreshModels();
  $("prompt").focus();
}

document.addEventListener("DOMContentLoaded", init);
