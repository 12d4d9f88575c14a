package main

import (
	"bufio"
	"os"
	"strings"
	"time"
)

// unitRules are the [Service] settings the unit must have, exactly: how it starts, restarts
// and is confined. (systemd-analyze verify, where installed, refuses unknown keys and bad
// values in the rest; see scripts/check-deploy.sh.)
var unitRules = map[string]string{
	"Type":            "simple",
	"Restart":         "on-failure",
	"KillSignal":      "SIGTERM",
	"NoNewPrivileges": "yes",
	"ProtectSystem":   "strict",
	"ProtectHome":     "yes",
	"PrivateTmp":      "yes",
}

// checkUnit reads the systemd unit's [Service] section: the rules above, an EnvironmentFile for
// the secrets, `effectively ... run -c FILE`, and a TimeoutStopSec that covers the revoke
// deadline and leaving the group, as the pod's grace period must.
func checkUnit(file string, revoke time.Duration, bad *problems) {
	f, err := os.Open(file)
	if err != nil {
		bad.add(file, "%v", err)
		return
	}
	defer f.Close()
	service := map[string]string{}
	section := ""
	scan := bufio.NewScanner(f)
	for n := 1; scan.Scan(); n++ {
		line := strings.TrimSpace(scan.Text())
		switch {
		case line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";"):
		case strings.HasPrefix(line, "[") && strings.HasSuffix(line, "]"):
			section = line
		default:
			k, v, ok := strings.Cut(line, "=")
			if !ok {
				bad.add(file, "line %d: not a key=value line: %q", n, line)
				continue
			}
			if section == "[Service]" {
				service[strings.TrimSpace(k)] = strings.TrimSpace(v)
			}
		}
	}
	if err := scan.Err(); err != nil {
		bad.add(file, "%v", err)
	}
	for k, want := range unitRules {
		if got, ok := service[k]; !ok || got != want {
			bad.add(file, "[Service] %s=%q; want %q", k, got, want)
		}
	}
	if service["EnvironmentFile"] == "" {
		bad.add(file, "[Service] no EnvironmentFile= for DATABASE_URL and the other secrets")
	}
	exec := strings.Fields(service["ExecStart"])
	hasRun, hasConfig := false, false
	for i, a := range exec {
		hasRun = hasRun || a == "run"
		hasConfig = hasConfig || ((a == "-c" || a == "--config") && i+1 < len(exec))
	}
	if len(exec) == 0 || !strings.HasSuffix(exec[0], "/effectively") || !hasRun || !hasConfig {
		bad.add(file, "[Service] ExecStart=%q is not `/…/effectively … run -c FILE`", service["ExecStart"])
	}
	stop, ok := service["TimeoutStopSec"]
	if !ok {
		bad.add(file, "[Service] no TimeoutStopSec= (systemd's 90 s default is not a decision)")
		return
	}
	d, err := unitDuration(stop)
	if err != nil {
		bad.add(file, "[Service] TimeoutStopSec=%q: %v", stop, err)
		return
	}
	if need := revoke + stopMargin; d < need {
		bad.add(file, "[Service] TimeoutStopSec=%s is below worker.revoke_deadline %s + %s = %s", stop, revoke, stopMargin, need)
	}
}

// unitDuration reads a systemd time span: plain seconds ("40") or with units ("40s", "1min").
func unitDuration(s string) (time.Duration, error) {
	if strings.Trim(s, "0123456789") == "" {
		s += "s"
	}
	return humantime(s)
}
