// Command validate builds a kustomization and decodes every resulting object strictly into its
// Kubernetes API type, the check a cluster's API server makes with strict field validation.
//
//	validate DIR
//
// DIR is a folder holding a kustomization.yaml (deploy/kubernetes/base, an overlay). The build is
// the kustomize API's (sigs.k8s.io/kustomize/api/krusty, as `kustomize build DIR`, default load
// restrictions). Each object is then decoded with the apimachinery serializer in strict mode into
// the Go type registered for its apiVersion and kind: core/v1, apps/v1, batch/v1, policy/v1, networking/v1,
// rbac/v1 and the Prometheus Operator's monitoring.coreos.com/v1. An unknown or duplicate field, a
// value of the wrong type, or a kind not registered here is an error.
//
// Exit status: 0 with the built YAML on stdout; 1 with one line per error on stderr; 2 on usage.
package main

import (
	"fmt"
	"os"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/runtime"
	serializerjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

func newScheme() (*runtime.Scheme, error) {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		corev1.AddToScheme,
		appsv1.AddToScheme,
		batchv1.AddToScheme,
		policyv1.AddToScheme,
		networkingv1.AddToScheme,
		rbacv1.AddToScheme,
		monitoringv1.AddToScheme,
	} {
		if err := add(scheme); err != nil {
			return nil, err
		}
	}
	return scheme, nil
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: validate KUSTOMIZATION_DIR")
		os.Exit(2)
	}
	dir := os.Args[1]
	resources, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kustomize build %s: %v\n", dir, err)
		os.Exit(1)
	}
	scheme, err := newScheme()
	if err != nil {
		fmt.Fprintf(os.Stderr, "scheme: %v\n", err)
		os.Exit(1)
	}
	strict := serializerjson.NewSerializerWithOptions(
		serializerjson.DefaultMetaFactory, scheme, scheme,
		serializerjson.SerializerOptions{Yaml: true, Strict: true},
	)
	failed := 0
	for _, res := range resources.Resources() {
		doc, err := res.AsYAML()
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", res.CurId(), err)
			failed++
			continue
		}
		if _, _, err := strict.Decode(doc, nil, nil); err != nil {
			fmt.Fprintf(os.Stderr, "%s %s/%s: %v\n", res.GetKind(), res.GetNamespace(), res.GetName(), err)
			failed++
		}
	}
	if failed > 0 {
		fmt.Fprintf(os.Stderr, "%d invalid objects in %s\n", failed, dir)
		os.Exit(1)
	}
	out, err := resources.AsYaml()
	if err != nil {
		fmt.Fprintf(os.Stderr, "yaml: %v\n", err)
		os.Exit(1)
	}
	if _, err := os.Stdout.Write(out); err != nil {
		os.Exit(1)
	}
}
