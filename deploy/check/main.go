// Command check validates the deployment examples under deploy/ offline: no cluster, no
// schemas downloaded (kubeconform's come from GitHub at run time).
//
//   - Each Kubernetes manifest is decoded strictly into k8s.io/api's typed struct for its
//     apiVersion and kind: an unknown or misspelt field, a wrong type, a duplicate key or an
//     unknown kind is refused.
//   - Then our own rules, which no schema knows (rules.go): the probes point at a container
//     port that exists, liveness is /healthz and readiness /readyz, the grace period covers
//     the ConfigMap's worker.revoke_deadline plus leaving the group, the config file the
//     container reads is the one the ConfigMap mounts, the PodDisruptionBudget and the Service
//     select the Deployment's pods, secrets come from a Secret, the pod runs as non-root on a
//     read-only root filesystem.
//   - The systemd unit: the keys we rely on (unit.go); `systemd-analyze verify` checks the rest
//     where it is installed (scripts/check-deploy.sh).
//
// Usage: check -k deploy/kubernetes -u deploy/systemd/effectively.service
// Exits 1 with one line per problem.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// manifests holds every decoded object, by kind.
type manifests struct {
	deployments []*appsv1.Deployment
	configMaps  map[string]*corev1.ConfigMap
	services    []*corev1.Service
	pdbs        []*policyv1.PodDisruptionBudget
}

// problems collects what is wrong, each with the file it is in.
type problems []string

func (p *problems) add(where, format string, args ...any) {
	*p = append(*p, where+": "+fmt.Sprintf(format, args...))
}

var separator = regexp.MustCompile(`(?m)^---\s*$`)

// decode reads one YAML document strictly into the typed struct its apiVersion and kind name.
func decode(m *manifests, where string, doc []byte, bad *problems) {
	var meta metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &meta); err != nil {
		bad.add(where, "not YAML: %v", err)
		return
	}
	strict := func(into any) bool {
		if err := yaml.UnmarshalStrict(doc, into); err != nil {
			bad.add(where, "%s %s: %v", meta.APIVersion, meta.Kind, err)
			return false
		}
		return true
	}
	switch meta.APIVersion + " " + meta.Kind {
	case "apps/v1 Deployment":
		d := &appsv1.Deployment{}
		if strict(d) {
			m.deployments = append(m.deployments, d)
		}
	case "v1 ConfigMap":
		c := &corev1.ConfigMap{}
		if strict(c) {
			m.configMaps[c.Name] = c
		}
	case "v1 Service":
		s := &corev1.Service{}
		if strict(s) {
			m.services = append(m.services, s)
		}
	case "policy/v1 PodDisruptionBudget":
		p := &policyv1.PodDisruptionBudget{}
		if strict(p) {
			m.pdbs = append(m.pdbs, p)
		}
	default:
		bad.add(where, "unexpected apiVersion/kind %q %q (this checker knows Deployment, ConfigMap, Service, PodDisruptionBudget)", meta.APIVersion, meta.Kind)
	}
}

func load(dir string, bad *problems) *manifests {
	m := &manifests{configMaps: map[string]*corev1.ConfigMap{}}
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		bad.add(dir, "no *.yaml manifests (%v)", err)
		return m
	}
	sort.Strings(files)
	for _, f := range files {
		text, err := os.ReadFile(f)
		if err != nil {
			bad.add(f, "%v", err)
			continue
		}
		for i, doc := range separator.Split(string(text), -1) {
			if len(bytes.TrimSpace([]byte(stripComments(doc)))) == 0 {
				continue
			}
			where := f
			if i > 0 {
				where = fmt.Sprintf("%s (document %d)", f, i+1)
			}
			decode(m, where, []byte(doc), bad)
		}
	}
	return m
}

// stripComments drops whole-line comments, to tell an empty document from a real one.
func stripComments(doc string) string {
	return regexp.MustCompile(`(?m)^\s*#.*$`).ReplaceAllString(doc, "")
}

func main() {
	dir := flag.String("k", "deploy/kubernetes", "folder of Kubernetes manifests")
	unit := flag.String("u", "deploy/systemd/effectively.service", "systemd unit file")
	flag.Parse()

	var bad problems
	m := load(*dir, &bad)
	revoke := checkKubernetes(m, &bad)
	checkUnit(*unit, revoke, &bad)
	if len(bad) > 0 {
		for _, p := range bad {
			fmt.Fprintln(os.Stderr, p)
		}
		fmt.Fprintf(os.Stderr, "deploy check: %d problem(s)\n", len(bad))
		os.Exit(1)
	}
	fmt.Printf("deploy check: %d deployment(s), %d configmap(s), %d service(s), %d pdb(s) and %s: ok\n",
		len(m.deployments), len(m.configMaps), len(m.services), len(m.pdbs), filepath.Base(*unit))
}
