// Drives the admin dashboard (src/admin/dashboard.html) in Debian's chromium for
// tests/dashboard.rs, which starts the proxy and passes, in the environment:
//   FULCRUM_ADMIN      the admin API's base URL
//   FULCRUM_TOKEN      its admin token
//   FULCRUM_CHROMIUM   the browser to launch
//   FULCRUM_SCREENSHOT where to save the screenshot
// and, when set, FULCRUM_SCREENSHOT_PHONE: where to save the page as a phone shows it.
// Prints one line per step; exits non-zero at the first failed expectation.
import { chromium } from "playwright-core";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const base = process.env.FULCRUM_ADMIN;
const token = process.env.FULCRUM_TOKEN;
const step = (msg) => console.log("step: " + msg);

function expect(cond, msg) {
  if (!cond) throw new Error("expectation failed: " + msg);
}

async function status() {
  const r = await fetch(base + "/status", { headers: { Authorization: "Bearer " + token } });
  expect(r.ok, "/status answers 200, got " + r.status);
  return r.json();
}

async function statusOf(name) {
  const s = await status();
  return s.vservers[0].services.find((x) => x.name === name);
}

// Poll `f` until it returns a truthy value.
async function until(what, f, ms = 15000) {
  const end = Date.now() + ms;
  for (;;) {
    const v = await f();
    if (v) return v;
    if (Date.now() > end) throw new Error("timed out waiting for " + what);
    await new Promise((r) => setTimeout(r, 100));
  }
}

// The probe's flags: without the background-networking ones, chromium's own connections are
// refused on a closed network.
const profile = mkdtempSync(join(tmpdir(), "fulcrum-chromium-"));
// A fresh, empty profile: playwright passes it as --user-data-dir.
const browser = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.FULCRUM_CHROMIUM,
  headless: true,
  viewport: { width: 1280, height: 720 },
  args: [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
  ],
});
let failed = false;
try {
  const page = browser.pages()[0] || await browser.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error" && !/401/.test(m.text())) errors.push(m.text()); });

  await page.goto(base + "/");
  step("page loaded without a token");

  // /status needs the token: the page asks for it.
  const tokenInput = page.getByLabel("Admin token");
  await tokenInput.waitFor({ state: "visible", timeout: 10000 });
  await tokenInput.fill(token);
  await page.getByRole("button", { name: "Use token" }).click();
  step("token given");

  const rows = page.locator('section[data-vserver="v"] tbody tr');
  await until("four services", async () => (await rows.count()) === 4);
  for (const name of ["s0", "s1", "s2"]) {
    await until(name + " UP on the page", async () =>
      (await page.locator(`tr[data-service="${name}"] .state`).textContent()) === "UP");
  }
  const s3name = await page.locator('tr[data-service="s3"] td').first().textContent();
  expect(s3name === "s3 (backup)", "the backup service is marked: " + s3name);
  expect((await statusOf("s3")).tier === "backup", "s3 in the backup tier in /status");
  step("four services visible, the primaries UP, s3 marked as backup");

  const s1 = page.locator('tr[data-service="s1"]');
  await page.getByRole("button", { name: "Disable s1" }).click();
  await until("s1 OUT_OF_SERVICE on the page", async () =>
    (await s1.locator(".state").textContent()) === "OUT_OF_SERVICE");
  expect((await statusOf("s1")).state === "OUT_OF_SERVICE", "s1 OUT_OF_SERVICE in /status");
  const announced = await until("the change announced", async () =>
    (await page.locator("#announce").textContent()).includes("s1"));
  expect(announced, "aria-live region names s1");
  step("s1 disabled: OUT_OF_SERVICE on the page and in /status");

  // Back by keyboard: the button keeps its place and takes Enter.
  const enable = page.getByRole("button", { name: "Enable s1" });
  await enable.focus();
  await page.keyboard.press("Enter");
  await until("s1 UP and starting", async () => (await s1.locator(".state").textContent()) === "UP");
  step("s1 enabled with the keyboard");

  // The manual ramp: the operator raises the rate and the page follows.
  const rateInput = page.getByLabel("New-service request rate");
  const seen = [];
  for (const rate of [2, 5, 10, 20]) {
    if (rate !== 2) {
      await rateInput.fill(String(rate));
      await page.getByRole("button", { name: "Set rate" }).click();
    }
    const cell = await until(`s1 at ${rate}/s on the page`, async () => {
      const t = await s1.locator('td[data-label="Slow start"]').textContent();
      return t.includes(`manual · ${rate} /s`) && t;
    });
    seen.push(rate);
    step(`slow start of s1 on the page: ${cell}`);
    const ss = (await statusOf("s1")).slow_start;
    expect(ss && ss.rate === rate, `/status says rate ${rate}: ${JSON.stringify(ss)}`);
  }
  expect(seen.every((r, i) => i === 0 || r > seen[i - 1]), "rate rose: " + seen);

  // Every button is named; every input has a label.
  const unnamed = await page.evaluate(() =>
    [...document.querySelectorAll("button")].filter((b) => !b.hidden && !(b.getAttribute("aria-label") || b.textContent.trim())).length);
  expect(unnamed === 0, "every button has a name");
  const unlabelled = await page.evaluate(() =>
    [...document.querySelectorAll("input")].filter((i) => i.labels.length === 0).length);
  expect(unlabelled === 0, "every input has a label");

  // Text contrast of at least 4.5:1 (WCAG 2.1, 1.4.3) for every text the page shows, in the
  // light and the dark scheme, with a badge of every state shown for the check.
  for (const colorScheme of ["light", "dark"]) {
    await page.emulateMedia({ colorScheme });
    const low = await page.evaluate(() => {
      const sample = document.createElement("div");
      sample.className = "panel";
      for (const st of ["UP", "DOWN", "OUT_OF_SERVICE", "EJECTED", "DRAINING", "other"]) {
        const badge = document.createElement("span");
        badge.className = "state st-" + st;
        badge.textContent = st;
        sample.append(badge);
      }
      document.querySelector("main").append(sample);
      const rgb = (c) => (c.match(/[\d.]+/g) || []).map(Number);
      const lum = ([r, g, b]) => {
        const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
        return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
      };
      const background = (e) => {
        for (; e; e = e.parentElement) {
          const c = rgb(getComputedStyle(e).backgroundColor);
          if (c.length === 3 || c[3] > 0) return c.slice(0, 3);
        }
        return [255, 255, 255];
      };
      const bad = [];
      let checked = 0;
      for (const e of document.querySelectorAll("body *")) {
        if (!e.offsetParent || ![...e.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim())) continue;
        const a = lum(rgb(getComputedStyle(e).color).slice(0, 3));
        const b = lum(background(e));
        const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
        checked += 1;
        if (ratio < 4.5) bad.push(e.tagName + " '" + e.textContent.trim().slice(0, 30) + "' " + ratio.toFixed(2));
      }
      sample.remove();
      return { bad, checked };
    });
    expect(low.checked > 40, "texts found to check: " + low.checked);
    const bad = low.bad;
    expect(bad.length === 0, colorScheme + ": contrast below 4.5:1: " + bad.join("; "));
    step(colorScheme + " scheme: " + low.checked + " texts, contrast at least 4.5:1");
  }
  await page.emulateMedia({ colorScheme: "light" });

  // Let the sparklines fill a little, then the picture README shows.
  await until("traffic on the sparklines", async () =>
    (await page.locator('tr[data-service="s0"] polyline').getAttribute("points") || "").split(" ").length >= 15);
  await page.screenshot({ path: process.env.FULCRUM_SCREENSHOT, fullPage: true });
  step("screenshot saved");

  // A phone: no sideways scrolling, services as cards.
  await page.setViewportSize({ width: 390, height: 844 });
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  expect(overflow <= 1, "no horizontal scrolling on a phone, overflow " + overflow);
  if (process.env.FULCRUM_SCREENSHOT_PHONE) {
    await page.screenshot({ path: process.env.FULCRUM_SCREENSHOT_PHONE, fullPage: true });
  }
  step("readable at 390 px wide");

  expect(errors.length === 0, "no script errors: " + errors.join("; "));
} catch (e) {
  failed = true;
  console.error(e && e.stack || String(e));
} finally {
  await browser.close();
  rmSync(profile, { recursive: true, force: true });
}
process.exit(failed ? 1 : 0);
