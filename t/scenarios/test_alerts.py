"""nginx-conf/prometheus-alerts.yml: it passes `promtool check rules`, its
unit tests (nginx-conf/prometheus-alerts.test.yml) pass `promtool test
rules`, every alert has a summary and a runbook_url naming a heading of
docs/operations.md, a test where it fires and one where it must not, and
the rules name only metrics the module serves."""

import os
import re
import subprocess

from harness import ROOT

RULES = os.path.join(ROOT, "nginx-conf", "prometheus-alerts.yml")
TESTS = os.path.join(ROOT, "nginx-conf", "prometheus-alerts.test.yml")


def promtool(h):
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ensure-promtool")],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300)
    h.check(p.returncode == 0, "no promtool: %s" % p.stderr.decode(errors="replace"))
    return p.stdout.decode().strip().splitlines()[-1]


def run(argv):
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120,
                       cwd=os.path.dirname(RULES))
    return p.returncode, p.stdout.decode(errors="replace")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def alerts():
    """{alert name: the text of its rule} (the file's `- alert:` items)."""
    parts = re.split(r"^\s*- alert:\s*", read(RULES), flags=re.M)[1:]
    return {p.split("\n", 1)[0].strip(): p for p in parts}


def test_promtool_check_rules(h):
    tool = promtool(h)
    rc, out = run([tool, "check", "rules", RULES])
    h.note(" ".join(out.split())[:200])
    h.check(rc == 0, "promtool check rules failed:\n%s" % out)


test_promtool_check_rules.timeout = 300


def test_promtool_test_rules(h):
    tool = promtool(h)
    rc, out = run([tool, "test", "rules", TESTS])
    h.note("%d alert checks in %d groups of series: %s"
           % (len(re.findall(r"^\s*- eval_time:", read(TESTS), re.M)),
              len(re.findall(r"^\s*- interval:", read(TESTS), re.M)), " ".join(out.split())[-60:]))
    h.check(rc == 0, "promtool test rules failed:\n%s" % out)


test_promtool_test_rules.timeout = 300


def test_every_alert_has_a_summary_a_runbook_and_tests(h):
    import test_docs
    headings = test_docs.anchors("docs/operations.md")
    tests = read(TESTS)
    rules = alerts()
    h.check(rules, "no alert in %s" % RULES)
    for name, text in rules.items():
        h.expect(re.search(r"^\s*summary:", text, re.M), "%s has no summary" % name)
        m = re.search(r"^\s*runbook_url:\s*(\S+)", text, re.M)
        if not h.expect(m, "%s has no runbook_url" % name):
            continue
        path, _, frag = m.group(1).partition("#")
        h.expect(path == "docs/operations.md" and frag in headings,
                 "%s: runbook_url %s names no heading of docs/operations.md" % (name, m.group(1)))
        h.expect(frag == name.lower(), "%s: its runbook section should be #%s, not #%s"
                 % (name, name.lower(), frag))
        checks = re.findall(r"alertname:\s*%s\s*\n\s*exp_alerts:(.*)" % re.escape(name), tests)
        h.expect(any(c.strip() == "" for c in checks),
                 "%s: no test in which it fires (exp_alerts with an alert)" % name)
        h.expect(any(c.strip().startswith("[]") for c in checks),
                 "%s: no test in which it stays silent (exp_alerts: [])" % name)
    h.note("%d alerts: %s" % (len(rules), ", ".join(rules)))


def test_the_rules_name_only_metrics_the_module_serves(h):
    served = set(re.findall(r'"(nginx_redis_ratelimit_\w+)"', read(os.path.join(ROOT, "core", "src", "metrics.rs"))))
    named = set(re.findall(r"\bnginx_redis_ratelimit_\w+", read(RULES)))
    unknown = sorted(n for n in named if n not in served and re.sub(r"_(bucket|sum|count)$", "", n) not in served)
    h.note("%d metrics named, all served" % len(named) if not unknown else "unknown: %s" % unknown)
    h.check(not unknown, "the rules name metrics the module does not serve: %s" % unknown)
