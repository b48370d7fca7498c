// -----// IR Dump After ccl //----- //
module {
  mesh.mesh @mesh0(shape = 2x2)
  func.func @main_graph(%arg0: tensor<4x64xf32>, %arg1: tensor<128x64xf32>, %arg2: tensor<128xf32>, %arg3: tensor<64x256xf32>, %arg4: tensor<64xf32>) -> tensor<4x64xf32> {
    %sharding = mesh.sharding @mesh0 split_axes = [[0]] : !mesh.sharding
    %sharding_1 = mesh.sharding @mesh0 split_axes = [[1]] : !mesh.sharding
    %sharding_2 = mesh.sharding @mesh0 split_axes = [[]] : !mesh.sharding
    %sharding_3 = mesh.sharding @mesh0 split_axes = [[0], [1]] : !mesh.sharding
    %x = mesh.shard %arg0 to %sharding : tensor<4x64xf32> loc("x")
    %v0.weight = mesh.shard %arg1 to %sharding_1 : tensor<128x64xf32> loc("0.weight")
    %v0.bias = mesh.shard %arg2 to %sharding_1 : tensor<128xf32> loc("0.bias")
    %v2.weight = mesh.shard %arg3 to %sharding_2 : tensor<64x256xf32> loc("2.weight")
    %v2.bias = mesh.shard %arg4 to %sharding_2 : tensor<64xf32> loc("2.bias")
    %1 = "onnx.Gemm"(%x, %v0.weight, %v0.bias) {alpha = 1.0 : f32, beta = 1.0 : f32, sharding = "[[0], [1], []]", transB = 1 : i64} : (tensor<4x64xf32>, tensor<128x64xf32>, tensor<128xf32>) -> tensor<4x128xf32> loc("/0/Gemm")
    %_0_Gemm_output_0 = mesh.shard %1 to %sharding_3 : tensor<4x128xf32> loc("/0/Gemm_output_0")
    %2 = "onnx.Relu"(%_0_Gemm_output_0) {sharding = "[[0], [1]]"} : (tensor<4x128xf32>) -> tensor<4x128xf32> loc("/1/Relu")
    %_1_Relu_output_0_c1 = mesh.shard %2 to %sharding_3 : tensor<4x128xf32> loc("/1/Relu_output_0~c1"("/1/Relu_output_0"))
    %3 = mesh.all_gather %_1_Relu_output_0_c1 on @mesh0 mesh_axes = [1] gather_axis = 1 : tensor<4x128xf32> -> tensor<4x256xf32>
    %_1_Relu_output_0 = mesh.shard %3 to %sharding : tensor<4x256xf32> loc("/1/Relu_output_0")
    %4 = "onnx.Gemm"(%_1_Relu_output_0, %v2.weight, %v2.bias) {alpha = 1.0 : f32, beta = 1.0 : f32, sharding = "[[0], [], []]", transB = 1 : i64} : (tensor<4x256xf32>, tensor<64x256xf32>, tensor<64xf32>) -> tensor<4x64xf32> loc("/2/Gemm")
    %y = mesh.shard %4 to %sharding : tensor<4x64xf32> loc("y")
    return %y : tensor<4x64xf32>
  }
}
