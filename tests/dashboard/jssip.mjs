// A browser softphone for tests/ws_browser.rs: JsSIP (from the npm registry, bundled here
// with esbuild) running in Debian's chromium, driven headless by playwright-core, with fake
// media devices. Environment:
//   FULCRUM_WS        the WebSocket URL of fulcrum's sip-ws vserver
//   FULCRUM_CHROMIUM  the browser to launch
// Prints one line per event ("event: registered", "event: incoming", "event: confirmed",
// "event: ended remote" ...). Reads commands on stdin: "hangup" ends the calls in progress
// from the browser, "quit" closes the browser and exits.
import { chromium } from "playwright-core";
import { build } from "esbuild";
import { fileURLToPath } from "node:url";
import { createInterface } from "node:readline";
import { createServer } from "node:http";

const entry = fileURLToPath(new URL("./node_modules/jssip/lib/JsSIP.js", import.meta.url));
const bundle = await build({
  entryPoints: [entry],
  bundle: true,
  format: "iife",
  globalName: "JsSIP",
  platform: "browser",
  write: false,
  logLevel: "silent",
});

const browser = await chromium.launch({
  executablePath: process.env.FULCRUM_CHROMIUM,
  args: [
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
    "--no-sandbox",
    // fulcrum's certificate is issued by the test's own CA.
    "--ignore-certificate-errors",
  ],
});
const page = await browser.newPage();
page.on("console", (m) => {
  const t = m.text();
  if (t.startsWith("event: ") || process.env.FULCRUM_JSSIP_DEBUG) console.log(t);
});
page.on("pageerror", (e) => console.log("event: pageerror " + e.message));
// The page comes from a web server on loopback, as a softphone's page comes from its site
// (a page of no origin may not open connections to loopback: Local Network Access).
const site = createServer((req, res) => {
  res.writeHead(200, { "content-type": "text/html" });
  res.end("<!doctype html><title>phone</title>");
});
await new Promise((r) => site.listen(0, "127.0.0.1", r));
await page.goto(`http://127.0.0.1:${site.address().port}/`);
await page.addScriptTag({ content: bundle.outputFiles[0].text });
await page.evaluate((url) => {
  if (url.includes("debug")) JsSIP.debug.enable("JsSIP:*");
  const ua = new JsSIP.UA({
    sockets: [new JsSIP.WebSocketInterface(url)],
    uri: "sip:alice@example.com",
    register: true,
    register_expires: 600,
    session_timers: false,
  });
  window.sessions = [];
  ua.on("connected", () => console.log("event: connected"));
  ua.on("disconnected", (e) => console.log("event: disconnected " + (e && e.code)));
  ua.on("registered", () => console.log("event: registered"));
  ua.on("registrationFailed", (e) => console.log("event: registrationFailed " + e.cause));
  ua.on("newRTCSession", ({ session, originator }) => {
    if (originator !== "remote") return;
    window.sessions.push(session);
    console.log("event: incoming");
    session.on("confirmed", () => console.log("event: confirmed"));
    session.on("ended", (e) => console.log("event: ended " + e.originator));
    session.on("failed", (e) => console.log("event: failed " + e.cause));
    session.answer({ mediaConstraints: { audio: true, video: false } });
  });
  ua.start();
  window.ua = ua;
}, process.env.FULCRUM_WS);
console.log("event: started");

for await (const line of createInterface({ input: process.stdin })) {
  if (line === "hangup") {
    await page.evaluate(() => {
      for (const s of window.sessions) if (!s.isEnded()) s.terminate();
    });
  } else if (line === "quit") {
    break;
  }
}
await page.evaluate(() => window.ua.stop()).catch(() => {});
await browser.close();
site.close();
// stdin stays open while the test holds it: leave now.
process.exit(0);
