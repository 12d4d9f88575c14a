package main

import (
	"fmt"
	"net"
	"path"
	"regexp"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// defaultRevokeDeadline is worker.revoke_deadline when the config does not set it
// (src/config/mod.rs, WorkerConfig::default).
const defaultRevokeDeadline = 20 * time.Second

// stopMargin is what a stop takes beyond the revoke deadline: leaving the group (the
// coordinator serves the last revocation for up to 5 s, src/source/consumer.rs) and 5 s of
// slack for the process to exit.
const stopMargin = 10 * time.Second

// checkKubernetes applies our rules to every Deployment; it returns the revoke deadline read
// from the (last) Deployment's config, for the systemd unit's stop timeout.
func checkKubernetes(m *manifests, bad *problems) time.Duration {
	revoke := defaultRevokeDeadline
	if len(m.deployments) == 0 {
		bad.add("kubernetes", "no Deployment")
	}
	for _, d := range m.deployments {
		where := "Deployment " + d.Name
		tmpl := d.Spec.Template
		podLabels := labels.Set(tmpl.Labels)
		if !selects(d.Spec.Selector, podLabels) {
			bad.add(where, "spec.selector does not select the pod template's labels %v", tmpl.Labels)
		}
		if len(tmpl.Spec.Containers) == 0 {
			bad.add(where, "no container")
			continue
		}
		for i := range tmpl.Spec.Containers {
			c := &tmpl.Spec.Containers[i]
			cw := where + " container " + c.Name
			checkProbes(c, cw, bad)
			checkMetricsAddr(c, cw, bad)
			checkSecrets(c, cw, bad)
			checkSecurity(&tmpl.Spec, c, cw, bad)
			checkResources(c, cw, bad)
			if r, ok := configRevokeDeadline(m, &tmpl.Spec, c, cw, bad); ok {
				revoke = r
			}
		}
		grace := tmpl.Spec.TerminationGracePeriodSeconds
		need := revoke + stopMargin
		switch {
		case grace == nil:
			bad.add(where, "terminationGracePeriodSeconds unset (Kubernetes' 30 s default); it must be at least worker.revoke_deadline %s + %s", revoke, stopMargin)
		case time.Duration(*grace)*time.Second < need:
			bad.add(where, "terminationGracePeriodSeconds %d is below worker.revoke_deadline %s + %s to leave the group = %s", *grace, revoke, stopMargin, need)
		}
		checkSelectors(m, d, podLabels, bad)
	}
	return revoke
}

func selects(sel *metav1.LabelSelector, set labels.Set) bool {
	if sel == nil {
		return false
	}
	s, err := metav1.LabelSelectorAsSelector(sel)
	return err == nil && !s.Empty() && s.Matches(set)
}

// findPort says whether `port` (a name or a number) is one of the container's ports, and its
// number.
func findPort(c *corev1.Container, port intstr.IntOrString) (int32, bool) {
	for _, p := range c.Ports {
		if port.Type == intstr.String && p.Name == port.StrVal {
			return p.ContainerPort, true
		}
		if port.Type == intstr.Int && p.ContainerPort == port.IntVal {
			return p.ContainerPort, true
		}
	}
	return 0, false
}

// checkProbes: liveness on /healthz, readiness on /readyz (never the other way round: a
// database outage would restart every pod), startup (if any) on /healthz, each on a port the
// container declares, all on the same port.
func checkProbes(c *corev1.Container, where string, bad *problems) {
	probes := []struct {
		name  string
		probe *corev1.Probe
		path  string
		need  bool
	}{
		{"livenessProbe", c.LivenessProbe, "/healthz", true},
		{"readinessProbe", c.ReadinessProbe, "/readyz", true},
		{"startupProbe", c.StartupProbe, "/healthz", false},
	}
	ports := map[int32]bool{}
	for _, p := range probes {
		if p.probe == nil {
			if p.need {
				bad.add(where, "no %s", p.name)
			}
			continue
		}
		get := p.probe.HTTPGet
		if get == nil {
			bad.add(where, "%s is not an httpGet of %s", p.name, p.path)
			continue
		}
		if get.Path != p.path {
			bad.add(where, "%s checks %q; it must check %q", p.name, get.Path, p.path)
		}
		n, ok := findPort(c, get.Port)
		if !ok {
			bad.add(where, "%s port %s is not a port of the container", p.name, get.Port.String())
			continue
		}
		ports[n] = true
	}
	if len(ports) > 1 {
		bad.add(where, "the probes use different ports; /healthz and /readyz are served on one")
	}
}

var loopback = map[string]bool{"127.0.0.1": true, "localhost": true, "::1": true}

// flagValue returns the value after `flag` (or in `flag=value`) among the container's
// command and args.
func flagValue(c *corev1.Container, names ...string) (string, bool) {
	all := append(append([]string{}, c.Command...), c.Args...)
	for i, a := range all {
		for _, n := range names {
			if a == n && i+1 < len(all) {
				return all[i+1], true
			}
			if v, ok := strings.CutPrefix(a, n+"="); ok {
				return v, true
			}
		}
	}
	return "", false
}

// checkMetricsAddr: --metrics-addr on all interfaces (the default is loopback, which neither
// the kubelet nor Prometheus reaches), on the port the probes use.
func checkMetricsAddr(c *corev1.Container, where string, bad *problems) {
	addr, ok := flagValue(c, "--metrics-addr")
	if !ok {
		bad.add(where, "no --metrics-addr: the endpoint would listen on 127.0.0.1, out of the probes' reach")
		return
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		bad.add(where, "--metrics-addr %q: %v", addr, err)
		return
	}
	if loopback[host] {
		bad.add(where, "--metrics-addr %q listens on loopback, out of the probes' reach", addr)
	}
	n, err := strconv.Atoi(port)
	if err != nil {
		bad.add(where, "--metrics-addr %q: port %q", addr, port)
		return
	}
	if c.LivenessProbe != nil && c.LivenessProbe.HTTPGet != nil {
		if p, ok := findPort(c, c.LivenessProbe.HTTPGet.Port); ok && int(p) != n {
			bad.add(where, "--metrics-addr port %d is not the probes' port %d", n, p)
		}
	}
}

var secretName = regexp.MustCompile(`(?i)(DATABASE_URL|PASSWORD|SECRET|TOKEN)`)

// checkSecrets: the database URL and passwords come from a Secret, never a literal value.
func checkSecrets(c *corev1.Container, where string, bad *problems) {
	for _, e := range c.Env {
		if !secretName.MatchString(e.Name) {
			continue
		}
		if e.Value != "" || e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil {
			bad.add(where, "env %s must come from a Secret (valueFrom.secretKeyRef)", e.Name)
		}
	}
}

func checkSecurity(pod *corev1.PodSpec, c *corev1.Container, where string, bad *problems) {
	nonRoot := pod.SecurityContext != nil && pod.SecurityContext.RunAsNonRoot != nil && *pod.SecurityContext.RunAsNonRoot
	sc := c.SecurityContext
	if sc != nil && sc.RunAsNonRoot != nil {
		nonRoot = *sc.RunAsNonRoot
	}
	if !nonRoot {
		bad.add(where, "runAsNonRoot is not true")
	}
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		bad.add(where, "securityContext.readOnlyRootFilesystem is not true")
	}
	if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		bad.add(where, "securityContext.allowPrivilegeEscalation is not false")
	}
}

func checkResources(c *corev1.Container, where string, bad *problems) {
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if _, ok := c.Resources.Requests[r]; !ok {
			bad.add(where, "no resources.requests.%s", r)
		}
	}
	if _, ok := c.Resources.Limits[corev1.ResourceMemory]; !ok {
		bad.add(where, "no resources.limits.memory")
	}
}

// configRevokeDeadline follows `-c FILE` to the ConfigMap volume mounted over FILE's folder
// and reads worker.revoke_deadline from it (the default when unset).
func configRevokeDeadline(m *manifests, pod *corev1.PodSpec, c *corev1.Container, where string, bad *problems) (time.Duration, bool) {
	file, ok := flagValue(c, "-c", "--config")
	if !ok {
		bad.add(where, "no -c/--config: the engine would read ./effectively.toml")
		return 0, false
	}
	dir, key := path.Split(file)
	dir = strings.TrimSuffix(dir, "/")
	for _, mount := range c.VolumeMounts {
		if mount.MountPath != dir {
			continue
		}
		for _, v := range pod.Volumes {
			if v.Name != mount.Name {
				continue
			}
			if v.ConfigMap == nil {
				bad.add(where, "%s is mounted from volume %s, which is not a ConfigMap", dir, v.Name)
				return 0, false
			}
			cm, ok := m.configMaps[v.ConfigMap.Name]
			if !ok {
				bad.add(where, "ConfigMap %s (volume %s) is not among the manifests", v.ConfigMap.Name, v.Name)
				return 0, false
			}
			text, ok := cm.Data[key]
			if !ok {
				bad.add(where, "ConfigMap %s has no key %s for -c %s", cm.Name, key, file)
				return 0, false
			}
			d, err := revokeDeadline(text)
			if err != nil {
				bad.add("ConfigMap "+cm.Name, "%s: %v", key, err)
				return 0, false
			}
			return d, true
		}
		bad.add(where, "volume %s of mount %s is not defined", mount.Name, dir)
		return 0, false
	}
	bad.add(where, "-c %s: no volume is mounted at %s", file, dir)
	return 0, false
}

var (
	tomlTable  = regexp.MustCompile(`^\s*\[\s*([A-Za-z0-9_.\[\]" -]+?)\s*\]\s*(#.*)?$`)
	tomlRevoke = regexp.MustCompile(`^\s*revoke_deadline\s*=\s*"([^"]*)"\s*(#.*)?$`)
)

// revokeDeadline reads `revoke_deadline` of the config's `[worker]` table: a line scan, enough
// for the one key (the engine's own loader checks the whole file: `effectively check-config`).
func revokeDeadline(config string) (time.Duration, error) {
	table := ""
	for _, line := range strings.Split(config, "\n") {
		if t := tomlTable.FindStringSubmatch(line); t != nil {
			table = t[1]
			continue
		}
		if table != "worker" {
			continue
		}
		if v := tomlRevoke.FindStringSubmatch(line); v != nil {
			return humantime(v[1])
		}
	}
	return defaultRevokeDeadline, nil
}

// humantime reads the durations the engine's config takes ("20s", "1m 30s", "500ms", "2min").
func humantime(s string) (time.Duration, error) {
	replacer := strings.NewReplacer(" ", "", "mins", "m", "min", "m", "secs", "s", "sec", "s", "hours", "h", "hour", "h")
	d, err := time.ParseDuration(replacer.Replace(s))
	if err != nil {
		return 0, fmt.Errorf("revoke_deadline %q: %v", s, err)
	}
	return d, nil
}

// checkSelectors: a PodDisruptionBudget and a Service select the Deployment's pods, and the
// Service's target port is one the pods declare.
func checkSelectors(m *manifests, d *appsv1.Deployment, pods labels.Set, bad *problems) {
	where := "Deployment " + d.Name
	budgeted := false
	for _, p := range m.pdbs {
		if selects(p.Spec.Selector, pods) {
			budgeted = true
		} else {
			bad.add("PodDisruptionBudget "+p.Name, "its selector does not select Deployment %s's pods %v", d.Name, map[string]string(pods))
		}
	}
	if !budgeted {
		bad.add(where, "no PodDisruptionBudget selects its pods")
	}
	served := false
	for _, s := range m.services {
		sw := "Service " + s.Name
		if len(s.Spec.Selector) == 0 || !labels.SelectorFromSet(s.Spec.Selector).Matches(pods) {
			bad.add(sw, "its selector %v does not select Deployment %s's pods", s.Spec.Selector, d.Name)
			continue
		}
		served = true
		for _, sp := range s.Spec.Ports {
			target := sp.TargetPort
			if target.Type == intstr.Int && target.IntVal == 0 {
				target = intstr.FromInt32(sp.Port)
			}
			found := false
			for i := range d.Spec.Template.Spec.Containers {
				if _, ok := findPort(&d.Spec.Template.Spec.Containers[i], target); ok {
					found = true
				}
			}
			if !found {
				bad.add(sw, "port %s: targetPort %s is not a port of Deployment %s's containers", sp.Name, target.String(), d.Name)
			}
		}
	}
	if !served && d.Spec.Template.Annotations["prometheus.io/scrape"] != "true" {
		bad.add(where, "neither a Service nor prometheus.io annotations expose its metrics port")
	}
}
