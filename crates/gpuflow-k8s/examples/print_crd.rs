fn main() {
    print!("{}", gpuflow_k8s::manifests::crd_yaml());
}
